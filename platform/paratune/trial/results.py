"""The trial records: what one trial measured, or why it failed (pydantic only, no torch).

verdict, the console tables, the sweep's ledger and page, and tracking read these records; they
never import the worker side (paratune.cluster.trial), so reading results never loads torch or Ray.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from paratune.trial.failures import Reason
from paratune.config.plan import Plan


class TrialResult(BaseModel):
    """What one trial measured, or why it failed."""

    # stopped_early: a loser seen in its first measured steps (measure.TrialStopRule); its partial
    # figures are kept, and it is neither a failure nor a full measurement.
    status: Literal["ok", "failed", "stopped_early"]
    reason: Reason | None = None
    message: str | None = None
    plan: dict[str, Any]
    world_size: int
    device: str = "unknown"
    tokens_per_step: int = 0
    tokens_per_s_per_gpu: float | None = None
    step_time_median_s: float | None = None
    step_time_p10_s: float | None = None
    step_time_p90_s: float | None = None
    step_time_spread: float | None = None  # (p90 - p10) / median
    mfu: float | None = None
    flops_per_token: float | None = None
    peak_memory_bytes: list[int] = Field(default_factory=list)  # per rank
    local_parameter_counts: list[int] = Field(default_factory=list)  # per rank: what it holds
    memory_method: str | None = None
    construction_peak_bytes: list[int | None] = Field(default_factory=list)  # per rank, model build + layout
    construction_method: str | None = None
    construction_s: float | None = None  # slowest rank's model build + layout + init (part of launch)
    linear_matmul_dtypes: dict[str, int] = Field(default_factory=dict)  # one warm-up step, all ranks
    optimizer_class: str | None = None  # what stepped: AdamW, DeepSpeedCPUAdam, ...
    model_init: str | None = None  # where the starting weights came from (paratune.model.build.model_init)
    comm_share: float | None = None
    comm_method: str | None = None
    # Time the measured steps waited for their micro-batches (inside the step's clock: the DataLoader's
    # next() before the first forward), slowest rank per step: the median, and the share of the steps' time.
    data_wait_s: float | None = None
    data_wait_share: float | None = None
    # The part of comm_share with an all-to-all in flight (expert parallelism's dispatch and
    # combine; 0 without ep), from the same profiled step.
    all_to_all_share: float | None = None
    # Mixture-of-experts models: tokens routed to each expert, per MoE layer (model order), summed
    # over all ranks; each layer's balance is its busiest expert over the mean (1.0: perfect), and
    # routing_balance is the worst layer's. None / empty for dense models (and older ledgers).
    routing_balance: float | None = None
    routing_balance_per_layer: list[float | None] = Field(default_factory=list)
    expert_tokens: list[list[int]] = Field(default_factory=list)
    routing_method: str | None = None
    losses: list[float] = Field(default_factory=list)  # every step, warm-up included
    step_times_s: list[float] = Field(default_factory=list)  # measured steps (slowest rank)
    launch_s: float | None = None  # trial start to first step
    # Compiled plans only: the first warm-up step's time minus the median measured step (slowest
    # rank both): what compiling the blocks cost (~0 when a reused group's caches served them),
    # never part of the measured steps. compile_graphs: Dynamo graphs the warm-up compiled.
    compile_s: float | None = None
    compile_graphs: int | None = None
    # The loss's form that ran (plan.loss with auto resolved by the model) and why auto fell back
    # to standard (a head tied to the embedding ...); None where the trial did not say.
    loss_form: str | None = None
    loss_form_fallback: str | None = None
    wall_s: float | None = None
    started_at: float | None = None  # epoch seconds the trial's launch began (ends at + wall_s)
    env_seen: dict[str, str | None] = Field(default_factory=dict)  # plan env as workers saw it
    # Where every rank ran: rank, node_id, node_ip, local_rank, local_world_size (paratune.trial.placement).
    placement: list[dict[str, Any]] = Field(default_factory=list)
    waited_for_nodes_s: float | None = None  # the autoscaler's time to bring nodes up (not launch)
    # Measured in a reused worker group (paratune.cluster.session): which, and the how-manieth request
    # (1: this trial paid the group's launch). None: a worker group of its own.
    group_id: str | None = None
    group_request: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def stopped_early(self) -> bool:
        return self.status == "stopped_early"

    @classmethod
    def failed(cls, plan: Plan | dict, reason: Reason, message: str, world_size: int = 0, **kw: Any) -> "TrialResult":
        plan_dict = plan.to_dict() if isinstance(plan, Plan) else dict(plan)
        return cls(status="failed", reason=reason, message=message, plan=plan_dict,
                   world_size=world_size or int(plan_dict.get("num_workers", 0) or 0), **kw)


class SessionTrialResult(TrialResult):
    """A TrialResult measured in a session group, with what proves where it ran."""

    worker_pids: list[int] = []  # per rank

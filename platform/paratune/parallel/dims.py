"""The parallel dimensions of a plan and the device mesh they make (pp x dp x cp x tp).

tp is innermost, so a tensor-parallel group is made of consecutive ranks (the GPUs of one
node); cp next (ring attention over neighbours); pp is outermost, so stages talk across nodes.
Under hybrid sharding the dp axis is itself split into dp_replicate x dp_shard (shard inside a
node, replicate across nodes), the layout torchtitan uses. The cp ranks of a dp rank see the
same sequences (each its part of them), so they hold parameters like dp ranks: FSDP2 shards
over dp_shard x cp. The rules themselves are checked by the Plan before any worker starts; this
only lays ranks out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from paratune.config.plan import Plan


def hybrid_shard_degree(plan: Plan, local_world_size: int) -> int:
    """dp ranks per shard group under hybrid sharding: the plan's `shard_group_size`, else the
    dp ranks of one node (its workers over tp), never more than dp."""
    assert plan.fsdp is not None
    if plan.fsdp.shard_group_size is not None:
        return plan.fsdp.shard_group_size
    return max(1, min(plan.dp_degree, local_world_size // plan.tp))


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    device_type: str
    dp_shard: int = 0  # dp ranks per shard group; 0 = the whole dp axis (no replication)
    cp: int = 1

    @classmethod
    def from_plan(cls, plan: Plan, device_type: str, local_world_size: int | None = None) -> "ParallelDims":
        shard = 0
        if plan.fsdp is not None and plan.fsdp.sharding == "hybrid":
            shard = hybrid_shard_degree(plan, local_world_size or plan.num_workers)
            if plan.dp_degree % shard or shard < 2:
                raise ValueError(f"fsdp.shard_group_size: {shard} dp ranks per shard group must divide dp "
                                 f"{plan.dp_degree} and be >= 2 for hybrid sharding")
        return cls(plan.dp_degree, plan.tp, plan.pp, device_type, shard, plan.cp)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1 or self.cp > 1

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard if self.dp_shard else 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp index, dp index, tp index) of a global rank (the cp index is `cp_rank`)."""
        pp_idx, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp_idx, rest = divmod(rest, self.cp * self.tp)
        return pp_idx, dp_idx, rest % self.tp

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)[1]

    @cached_property
    def mesh(self):
        """The world mesh: pp x dp_replicate x dp_shard x cp x tp."""
        from torch.distributed.device_mesh import init_device_mesh

        replicate = self.dp_replicate
        return init_device_mesh(self.device_type, (self.pp, replicate, self.dp // replicate, self.cp, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))

    @cached_property
    def dp_mesh(self):
        """Every rank that holds the same parameters (the dp axis, and cp with it) as one dimension:
        DDP and replicate reduce gradients over it, plain FSDP2 shards over it."""
        return self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")

    @cached_property
    def cp_mesh(self):
        return self.mesh["cp"]

    def fsdp_mesh(self):
        """The mesh FSDP2 shards over: 2-D (replicate, shard) under hybrid sharding (the plan
        refuses hybrid with cp), else the whole dp x cp axis."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_shard else self.dp_mesh

"""The parallel dimensions of a plan and the device mesh they make (pp x dp x tp).

tp is innermost, so a tensor-parallel group is made of consecutive ranks (the GPUs of one
node); pp is outermost, so stages talk across nodes. The rules themselves are checked by the
Plan before any worker starts; this only lays ranks out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from paratune.plan import Plan


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    device_type: str

    @classmethod
    def from_plan(cls, plan: Plan, device_type: str) -> "ParallelDims":
        return cls(plan.dp_degree, plan.tp, plan.pp, device_type)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp index, dp index, tp index) of a global rank."""
        pp_idx, rest = divmod(rank, self.dp * self.tp)
        dp_idx, tp_idx = divmod(rest, self.tp)
        return pp_idx, dp_idx, tp_idx

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)[1]

    @cached_property
    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))

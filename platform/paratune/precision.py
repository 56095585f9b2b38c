"""Which precision the matmuls really ran in: a plan that says bf16 must compute in bf16.

Autocast, FSDP2's MixedPrecisionPolicy and DeepSpeed's bf16 engine each decide the compute
dtype in a different place, and a path that forgets (a pipeline stage, a tensor-parallel plan
without FSDP) silently trains and is measured in fp32. This records, for one step, the dtype of
every matmul an `nn.Linear` forward dispatches (after autocast has cast its inputs), so a trial
reports what it computed in and a test can hold every path to its plan.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}


class LinearMatmulDtypes(TorchDispatchMode):
    """Counts matmuls dispatched inside nn.Linear forwards by dtype (e.g. {"bfloat16": 14})."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._depth = 0
        self._handles: list = []

    def __enter__(self) -> "LinearMatmulDtypes":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(module: nn.Module, args):
            if isinstance(module, nn.Linear):
                self._depth += 1

        def leave(module: nn.Module, args, output):
            if isinstance(module, nn.Linear):
                self._depth -= 1

        self._handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._depth > 0 and func.overloadpacket.__name__ in _MATMULS:
            matrices = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            if matrices:
                self.counts[str(matrices[0].dtype).removeprefix("torch.")] += 1
        return func(*args, **(kwargs or {}))


def expected_compute_dtype(precision: str) -> str:
    return {"bf16": "bfloat16", "fp32": "float32"}[precision]

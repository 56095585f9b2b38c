"""Which precision the matmuls really ran in: a plan that says bf16 must compute in bf16.

Autocast, FSDP2's MixedPrecisionPolicy and DeepSpeed's bf16 engine each decide the compute
dtype in a different place, and a path that forgets (a pipeline stage, a tensor-parallel plan
without FSDP) silently trains and is measured in fp32. This records, for one step, the dtype of
every matmul an `nn.Linear` forward dispatches (after autocast has cast its inputs), so a trial
reports what it computed in and a test can hold every path to its plan.

A float8 plan (torchao's Float8Linear, paratune.parallel.float8) runs each converted linear's
matmul on float8 operands: the recorder unwraps torchao's float8 tensors (and DTensors around
them) to the dtype `_scaled_mm` receives (float8_e4m3fn in the forward, both recipes), and a
matmul inside a float8 linear that did not get float8 operands is counted apart ("bfloat16 in a
float8 linear"), so `precision_problem` can tell a converted linear that fell back from the
bf16 LM head that was never converted.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
FLOAT8_FORWARD = "float8_e4m3fn"  # what a converted linear's forward matmul runs on (both recipes)
IN_FLOAT8_LINEAR = " in a float8 linear"  # suffix of a converted linear's matmul that was not float8


def operand_dtype(t: torch.Tensor) -> str:
    """The dtype a matmul really computes on: a DTensor's local shard, a torchao float8 tensor's
    float8 data (its own `dtype` is the high-precision one it stands for)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    data = getattr(t, "_data", None)  # torchao's Float8TrainingTensor: float8 `_data` and a `_scale`
    if isinstance(data, torch.Tensor) and hasattr(t, "_scale"):
        t = data
    return str(t.dtype).removeprefix("torch.")


def _is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"  # torchao's; not imported (it is optional)


class LinearMatmulDtypes(TorchDispatchMode):
    """Counts matmuls dispatched inside nn.Linear forwards by dtype (e.g. {"bfloat16": 14})."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._depth = 0
        self._float8: list[bool] = []  # per entered linear: is it a float8 one (innermost last)
        self._handles: list = []

    def __enter__(self) -> "LinearMatmulDtypes":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(module: nn.Module, args):
            if isinstance(module, nn.Linear):
                self._depth += 1
                self._float8.append(_is_float8_linear(module))

        def leave(module: nn.Module, args, output):
            if isinstance(module, nn.Linear):
                self._depth -= 1
                self._float8.pop()

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
                dtypes = [operand_dtype(m) for m in matrices[:2]]
                key = dtypes[0] if len(set(dtypes)) == 1 else " x ".join(dtypes)
                if self._float8 and self._float8[-1] and not key.startswith("float8"):
                    key += IN_FLOAT8_LINEAR
                self.counts[key] += 1
        return func(*args, **(kwargs or {}))


def expected_compute_dtype(precision: str) -> str:
    return {"bf16": "bfloat16", "fp32": "float32"}[precision]


def precision_problem(precision: str, float8: str, counts: dict[str, int]) -> str | None:
    """Why a trial's linear matmuls (`LinearMatmulDtypes.counts`, summed over ranks) did not run in
    its plan's precision; None when they did. A float8 plan passes exactly when every converted
    linear ran on float8 operands and every other linear (the LM head, the skipped ones) in bf16."""
    if not counts:
        return "no linear matmul was recorded"
    want = expected_compute_dtype(precision)
    if float8 == "none":
        wrong = {k: n for k, n in counts.items() if k != want}
        return f"linear matmuls not in {want}: {wrong}" if wrong else None
    if not counts.get(FLOAT8_FORWARD):
        return f"float8 '{float8}': no linear matmul ran in {FLOAT8_FORWARD}: {dict(counts)}"
    wrong = {k: n for k, n in counts.items() if k not in (FLOAT8_FORWARD, want)}
    return (f"float8 '{float8}': matmuls neither float8 in a converted linear nor {want} in another: {wrong}"
            if wrong else None)

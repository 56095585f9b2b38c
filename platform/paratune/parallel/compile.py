"""torch.compile of each decoder block (paratune.levers), and the check that a trial really ran compiled.

Each block's `__call__` is compiled in place (`nn.Module.compile`: the module keeps its place, its
parameters and its class, so tp's DTensor parameters, FSDP2's `fully_shard` and DDP applied
afterwards see the module they expect; torchtitan's order: tp, checkpointing, compile, then the
data-parallel wrap). All blocks of one class run the same code object, so with `use_cache=False`
(paratune.model.build sets it; with a cache each layer's `layer_idx` becomes a guard and every block
its own graph) one Dynamo graph serves them all, compiled on the first step and reused by every
later step, block and, in a reused worker group, plan of the same shapes and layout.

A compiled trial must never be measured half eager: `CompileWatch` counts Dynamo's graphs and
graph breaks around the warm-up and the measured steps, and Dynamo's silent fallback to eager at
its recompile limit is turned into an error (`fail_on_recompile_limit_hit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import CodeType
from typing import Callable, TypeVar

import torch
from torch import nn

from paratune.config.plan import Plan

T = TypeVar("T")


# Why tp's embedding output is copied before the first compiled block (`resolve_async_embedding`):
# RowwiseParallel's output hook redistributes with async_op=True (torch/distributed/tensor/parallel/
# style.py:298) and hands the block an AsyncCollectiveTensor (grad_fn _ToTorchTensorBackward ->
# RedistributeBackward). AOTAutograd swaps that input for `trigger_wait()` (torch/_functorch/
# _aot_autograd/frontend_utils.py:73, subclass_codegen.py:270): the compiled block's input gradient
# then skips _ToTorchTensorBackward and reaches Redistribute.backward as a plain tensor, which fails
# at torch/distributed/tensor/_redistribute.py:1994 ("'Tensor' object has no attribute '_local_tensor'").
# Measured on 2 gloo processes, torch 2.13, tiny Llama, tp 2 with and without sequence parallelism.


def resolve_async_embedding(model: nn.Module) -> None:
    """Make tp's embedding hand the first compiled block a plain tensor (see the note above):
    paratune.parallel.tp's own copy of the embedding's output, installed once (tp installs it too)."""
    from paratune.model.build import decoder_parts
    from paratune.parallel.tp import own_embedding_output

    embedding = decoder_parts(model).embedding
    if embedding is not None:
        own_embedding_output(embedding)


# Inductor's options for an async-TP plan's blocks: its micro-pipeline pass fuses the
# sequence-parallel all-gather / reduce-scatter into the matmuls. Passed to this plan's compile,
# never set in Inductor's global config: a global flag outlived the plan in a reused worker group
# (the next plan's graphs fused too), and Dynamo tells cached graphs apart by their compile options,
# not by the global config (torch/__init__.py _TorchCompileInductorWrapper.__eq__), so a later
# async plan would have reused an unfused graph. Static shapes for every plan (`dynamic=False`):
# Dynamo's automatic-dynamic state is kept per code object, every checkpointed block class shares
# one forward, so a second plan of the group with another micro-batch or width compiled those
# dimensions dynamic (slower kernels); static, it compiles a graph of its own instead.
ASYNC_TP_OPTIONS = {"_micro_pipeline_tp": True}


def compile_options(plan: Plan) -> dict:
    """`nn.Module.compile` kwargs of the plan's blocks (see ASYNC_TP_OPTIONS)."""
    return {"dynamic": False, **({"options": dict(ASYNC_TP_OPTIONS)} if plan.async_tp else {})}


def enable_async_tp(plan: Plan, device: torch.device, tp_group_name: str) -> None:
    """Async TP (torchtitan's way): Inductor's micro-pipeline pass (ASYNC_TP_OPTIONS, in the
    blocks' compile) over symmetric memory of the tp group. CUDA only; set before the blocks
    compile. Its workers serve no other plan (paratune.cluster.launch.WorkerDemand.single_use)."""
    if not plan.async_tp:
        return
    if device.type != "cuda":
        from paratune.levers import ASYNC_TP_CPU_REASON

        raise ValueError(f"async_tp: true on device '{device.type}': {ASYNC_TP_CPU_REASON}; allowed: false "
                         "off CUDA")
    set_async_tp(tp_group_name)


def set_async_tp(tp_group_name: str) -> None:
    """Symmetric memory for the tp group (its rank, size and store: torch/distributed/
    _symmetric_memory/__init__.py enable_symm_mem_for_group, which the micro-pipeline pass asks
    about by group name; deprecated in torch 2.13, still what the pass reads), device-free, so a
    CPU test can read it back. torch's registry is process-wide and refuses a group name twice:
    the reason an async-TP plan's workers are single-use."""
    import warnings

    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_group_name)


class CompileFallback(RuntimeError):
    """A compiled plan whose blocks did not run as one compiled graph each (a trial failure)."""


def block_codes(blocks: list[nn.Module]) -> list[CodeType]:
    """The code objects Dynamo compiles for these blocks: each class's `forward` (the compiled
    `__call__` enters Module._call_impl, which Dynamo skips as torch.nn code, and starts its frame
    at the forward it calls: transformers' checkpointing wrapper, one code object for every block
    class and for FSDP2's subclass of it)."""
    return list({type(block).forward.__code__: None for block in blocks})


def cache_entries(codes: list[CodeType]) -> int:
    """Dynamo's cache entries (one per graph and guard set) on these code objects."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return sum(len(_debug_get_cache_entry_list(code)) for code in codes)


def _skipped(codes: list[CodeType]) -> bool:
    """Whether Dynamo saw one of these codes and left it without a graph: it then marks the code
    SKIP for every later call in the process (torch/_dynamo/types.py ConvertFrameReturn's default),
    e.g. after a compiled block was first called under a TorchDispatchMode (convert_frame: "non-infra
    torch dispatch mode present"): no block of any later plan would compile."""
    from torch._dynamo import convert_frame
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return any(code in convert_frame.input_codes and not _debug_get_cache_entry_list(code) for code in codes)


def eager_blocks():
    """A context in which compiled blocks run eager, and Dynamo never sees them: for the steps a
    TorchDispatchMode observes (the matmul-dtype recorder, MemTracker), since a dispatch mode
    around a block's compiled call makes Dynamo skip it, and mark its code SKIP for good."""
    return torch.compiler.set_stance("force_eager")


def make_room_for_graphs(blocks: list[nn.Module]) -> None:
    """Reset Dynamo when the next plan's graphs could reach its recompile limit.

    Every compiled block of every plan a process runs adds its guards to the same code object
    (`block_codes`); at `recompile_limit` (8) entries Dynamo stops compiling it. A reused
    worker group running many compiled layouts would get there: the caches are dropped first
    (Inductor's on-disk cache stays, so the next compile is a warm one, ~1.4 s in the probe).
    A code Dynamo marked SKIP is reset too (the mark would outlive the plan that caused it)."""
    import torch._dynamo

    codes = block_codes(blocks)
    new_graphs = len({type(block) for block in blocks})
    if _skipped(codes) or cache_entries(codes) + new_graphs >= torch._dynamo.config.recompile_limit:
        torch._dynamo.reset()


def apply_lever(model: nn.Module, plan: Plan, place) -> None:  # noqa: ANN001 - a runner.WorkerPlace
    """The compile lever's runtime (paratune.levers.compile: stage before_wrap; async TP needs the
    rank's device and its tp group's name)."""
    compile_blocks(model, plan, place.device, place.tp_group_name)


def compile_blocks(model: nn.Module, plan: Plan, device: torch.device | None = None,
                   tp_group_name: str | None = None) -> None:
    """Compile every decoder block (after tp and checkpointing, before DDP / FSDP2 wrap them);
    under tp the plan's async TP is set up first (`device` and the tp group's name needed)."""
    if not plan.compile:
        return
    import torch._dynamo

    from paratune.model.build import decoder_blocks

    if plan.tp > 1:
        resolve_async_embedding(model)
        if plan.async_tp:
            if device is None or tp_group_name is None:
                raise ValueError("async_tp: true: compile_blocks needs the device and the tp group's name")
            enable_async_tp(plan, device, tp_group_name)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        raise ValueError("compile: true needs the model's config.use_cache False (with a KV cache every block's "
                         "layer_idx is a guard: one graph per block, and Dynamo's recompile limit is hit); "
                         "paratune.model.build.build_config sets it")
    blocks = decoder_blocks(model)
    # Never a silent eager fallback: at the recompile limit Dynamo raises instead (a trial failure).
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    make_room_for_graphs(blocks)
    kwargs = compile_options(plan)
    for block in blocks:
        block.compile(**kwargs)


@dataclass
class DynamoCounts:
    """Dynamo's process-wide counters at one moment (they only grow), and its cache entries on
    the compiled blocks' code (`block_codes`: one per graph it holds for them)."""

    graphs: int
    graph_breaks: int
    cache_entries: int

    @classmethod
    def now(cls, codes: list[CodeType]) -> "DynamoCounts":
        from torch._dynamo.utils import counters

        return cls(int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["graph_break"].values())),
                   cache_entries(codes))


class CompileWatch:
    """What Dynamo compiled during a compiled plan's warm-up and measured steps.

    started before the first step; `warmed_up()` after the last warm-up step: at most one new
    graph per block class (0: the process's cache served them, a reused worker group) and no
    graph break, and Dynamo holding a graph for the blocks' code (a skipped block leaves none:
    0 new graphs alone cannot tell a cache hit from a block that never compiled); `measured()` after the measured steps: nothing compiled in them (a recompile
    there would put compile time into the measurement). Any other outcome raises CompileFallback."""

    def __init__(self, block_classes: int, codes: list[CodeType]):
        self.block_classes, self.codes = block_classes, codes
        self.start = DynamoCounts.now(codes)
        self.warm: DynamoCounts | None = None

    def warmed_up(self) -> int:
        """Graphs compiled by the warm-up (raises CompileFallback where it was not one per block class)."""
        self.warm = DynamoCounts.now(self.codes)
        graphs = self.warm.graphs - self.start.graphs
        breaks = self.warm.graph_breaks - self.start.graph_breaks
        if breaks:
            raise CompileFallback(f"compile: true: {breaks} graph break(s) in the warm-up: the blocks ran partly "
                                  "eager; fix the break (TORCH_LOGS=graph_breaks) or set compile false")
        if self.warm.cache_entries == 0:
            raise CompileFallback("compile: true: Dynamo holds no graph for the blocks after the warm-up: they ran "
                                  "eager (skipped: e.g. a TorchDispatchMode around their first call)")
        if graphs > self.block_classes:
            raise CompileFallback(f"compile: true: the warm-up compiled {graphs} graphs for {self.block_classes} "
                                  "block class(es) (one each expected): the blocks do not share their graph "
                                  "(TORCH_LOGS=recompiles says why)")
        return graphs

    def measured(self) -> None:
        """Raises CompileFallback where the measured steps compiled anything."""
        assert self.warm is not None, "warmed_up() first"
        now = DynamoCounts.now(self.codes)
        if now.graphs != self.warm.graphs or now.graph_breaks != self.warm.graph_breaks:
            raise CompileFallback(f"compile: true: the measured steps compiled {now.graphs - self.warm.graphs} "
                                  f"graph(s) ({now.graph_breaks - self.warm.graph_breaks} graph breaks): a recompile "
                                  "inside the measurement (shapes or guards changed after the warm-up)")


def compiled_blocks(root: nn.Module) -> list[nn.Module]:
    """The compiled blocks under `root`, whatever wraps them: DDP, a DeepSpeed engine, pipeline stages."""
    return [module for module in root.modules() if getattr(module, "_compiled_call_impl", None) is not None]


def block_class_count(blocks: list[nn.Module]) -> int:
    """Distinct block classes (one Dynamo graph each); FSDP2's per-class subclass (FSDP<Block>, made
    in torch.distributed) counts as the block's own class."""
    return len({next(c for c in type(b).__mro__ if not c.__module__.startswith("torch.")) for b in blocks})


def watch_compiled(root: nn.Module, plan: Plan) -> CompileWatch | None:
    """A CompileWatch for a compiled plan's trial (None for an eager plan); start it before step 0."""
    if not plan.compile:
        return None
    blocks = compiled_blocks(root)
    if not blocks:
        raise CompileFallback("compile: true, but no compiled decoder block was found in the model the trial runs")
    return CompileWatch(block_class_count(blocks), block_codes(blocks))


def on_every_rank(check: Callable[[], T], device: torch.device) -> T:
    """Run a CompileWatch check on every rank and fail on all of them if it failed on one (a rank
    that raised alone would leave the others waiting in the next collective)."""
    import torch.distributed as dist

    result: T | None = None
    problem = ""
    try:
        result = check()
    except CompileFallback as err:
        problem = str(err)
    flag = torch.tensor([1.0 if problem else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise CompileFallback(problem or "compile: true: another rank's blocks did not run compiled (its log says why)")
    return result  # type: ignore[return-value]

"""The loss's forms (paratune.parallel.loss): vocab-parallel under tp, chunked for tp 1, auto's fallback.

One process: the chunked loss equals transformers' (loss and every gradient), never holds the whole
micro-batch's logits, and paratune's loss_parallel context is closed after a failure. Two real gloo
processes (one set for every case): each form trains like the single-process reference, and the
trial reports which form ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gloo_harness import batch_result, one_torch_thread, reference_for  # noqa: F401 (fixture)
from conftest import BASE_PLAN
from torch.utils._python_dispatch import TorchDispatchMode

from paratune.model.build import build_config
from paratune.parallel import loss as loss_forms
from paratune.sweep.parity import max_loss_difference
from paratune.config.plan import PlanError, load_plan_dict
from paratune.checks.preflight import check_plan_against_model


def _plan(**fields):
    return load_plan_dict({**BASE_PLAN, **fields})


def _tiny_model(model: str = "tiny-llama", **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(model, overrides), attn_implementation="sdpa")
    return model.train()


class VocabRowsRecorder(TorchDispatchMode):
    """The largest number of rows (tokens) of any new tensor an op produces whose last dimension is
    the vocabulary: logits, their log-softmax and gradients (views, e.g. the head's weight
    transposed, are not new tensors)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.max_rows, self.matmuls = vocab, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.max_rows = max(self.max_rows, t.numel() // self.vocab)
                self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return out


def _chunked_copy(model):
    chunked = copy.deepcopy(model)
    assert loss_forms.apply_loss_form(chunked, _plan(num_workers=1, loss="chunked")) == "chunked"
    return chunked


def test_chunked_equals_transformers_loss_and_gradients():
    model = _tiny_model()
    chunked = _chunked_copy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored tokens: the mean is over the labelled ones only
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(40)}):  # mean, and transformers' sum / count
        model.zero_grad(), chunked.zero_grad()
        want = model(input_ids=ids, labels=labels, **kwargs).loss
        got = chunked(input_ids=ids, labels=labels, **kwargs).loss
        want.backward(), got.backward()
        assert abs(got.item() - want.item()) < 1e-6, (got.item(), want.item(), kwargs)
        for (name, p), q in zip(chunked.named_parameters(), model.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), name


def test_chunked_never_holds_the_whole_logits():
    model = _tiny_model()
    vocab, tokens = model.config.vocab_size, 2 * 32
    chunk = loss_forms.chunk_tokens(tokens, vocab, model.config.hidden_size)
    assert chunk < tokens
    ids = torch.randint(0, vocab, (2, 32))
    seen = {}
    for name, m in (("standard", model), ("chunked", _chunked_copy(model))):
        with VocabRowsRecorder(vocab) as recorder:
            m(input_ids=ids, labels=ids).loss.backward()
        seen[name] = recorder
    assert seen["standard"].max_rows == tokens  # the recorder sees whole logits where they exist
    assert seen["chunked"].max_rows == chunk, seen["chunked"].max_rows
    # Every chunk's head matmul runs twice: in forward, and again (recomputed) in backward.
    assert seen["chunked"].matmuls >= 2 * (tokens // chunk)


def test_chunk_size_rule():
    assert loss_forms.chunk_tokens(8192, 128256, 4096) == 256  # Llama-3-8B: ceil(V/H) = 32 chunks
    assert loss_forms.chunk_tokens(64, 512, 64) == 8
    assert loss_forms.chunk_tokens(3, 512, 64) == 1
    assert loss_forms.chunk_tokens(100, 64, 512) == 128  # a vocabulary smaller than hidden: one chunk


def test_liger_only_on_cuda_when_importable(monkeypatch):
    assert not loss_forms.liger_available(torch.device("cpu"))
    monkeypatch.setattr(loss_forms.importlib.util, "find_spec", lambda name: object() if name == "liger_kernel" else None)
    assert loss_forms.liger_available(torch.device("cuda", 0))
    assert not loss_forms.liger_available(torch.device("cpu"))
    monkeypatch.setattr(loss_forms.importlib.util, "find_spec", lambda name: None)
    assert not loss_forms.liger_available(torch.device("cuda", 0))


def _loss_handlers() -> set:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    return set(customized_loss_ops) & set(DTensor._op_dispatcher._custom_op_handlers)


def test_loss_parallel_context_is_closed_after_a_failure():
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.distributed.tensor.parallel.loss import _disable_custom_loss_ops

    assert not _loss_handlers()
    with pytest.raises(RuntimeError, match="backward failed"):
        with loss_forms.loss_context("vocab_parallel"):
            assert _loss_handlers()  # loss_parallel's DTensor ops are on inside
            raise RuntimeError("backward failed")
    assert not _loss_handlers()  # and off after the failure: the next plan of the process is unaffected
    # What it guards against: torch's own context leaves them on.
    with pytest.raises(RuntimeError):
        with loss_parallel():
            raise RuntimeError("backward failed")
    try:
        assert _loss_handlers()
    finally:
        _disable_custom_loss_ops()


def test_auto_resolves_and_falls_back_with_the_reason():
    llama = build_config("tiny-llama", {})
    tied = build_config("tiny-llama", {"tie_word_embeddings": True})
    assert loss_forms.resolve_loss_form(_plan(tp=2), llama) == ("vocab_parallel", None)
    assert loss_forms.resolve_loss_form(_plan(), llama) == ("standard", None)
    assert loss_forms.resolve_loss_form(_plan(tp=2, strategy="zero", zero={"stage": 1}), llama) == ("standard", None)
    form, why = loss_forms.resolve_loss_form(_plan(tp=2), tied)
    assert form == "standard" and "tie_word_embeddings" in why
    form, why = loss_forms.resolve_loss_form(_plan(num_workers=4, tp=2, pp=2), llama)
    assert form == "standard" and "pp 2" in why
    # Gemma-2's soft-cap is pointwise: sharded logits take it (only its tied head keeps them gathered).
    gemma2_untied = build_config("tiny-gemma2", {"tie_word_embeddings": False})
    assert loss_forms.resolve_loss_form(_plan(tp=2, model="tiny-gemma2"), gemma2_untied) == ("vocab_parallel", None)


@pytest.mark.parametrize("fields, overrides, match", [
    ({"tp": 2, "loss": "vocab_parallel"}, {"tie_word_embeddings": True}, "tie_word_embeddings"),
    # (an explicit vocab_parallel with pp or cp: the plan's own rule, tests/test_levers.py)
    ({"loss": "chunked", "model": "tiny-gemma2"}, None, "final_logit_softcapping 30"),
])
def test_preflight_refuses_an_explicit_form_the_model_cannot_take(fields, overrides, match):
    plan = _plan(**fields, **({"model_overrides": overrides} if overrides is not None else {}))
    with pytest.raises(PlanError, match=f"loss: '{plan.loss}'.*{match}.*allowed"):
        check_plan_against_model(plan)


def test_head_layout_follows_the_recorded_form():
    from torch.distributed.tensor import Replicate, Shard

    from paratune.parallel.tp import head_style

    model = torch.nn.Module()
    for form, placement, local in (("vocab_parallel", Shard(-1), False), ("standard", Replicate(), True)):
        setattr(model, loss_forms.FORM_ATTR, form)
        style = head_style(model, Shard(1))
        assert (style.output_layouts[0], style.use_local_output, style.input_layouts[0]) == (placement, local, Shard(1))


# Real gloo processes, in test_parity_gloo's set of 2 processes (its `_runs(2)` batch runs these
# cases too): each form against the single-process reference (fp32: 1e-5, seen ~1e-7).
# Two steps (one warm-up, one measured): parity of the loss and of the update it makes.
LOSS_FORM_CASES = {
    "tp2-tied-auto-falls-back": ({"tp": 2, "model_overrides": {"tie_word_embeddings": True}}, "standard"),
    # Gemma-2's final-logit soft-cap (tanh) on the vocab-sharded logits; lr 1e-3 as test_families
    # runs Gemma-2 (at 1e-2 it is chaotic at the 1e-5 level even on one process).
    "tp2-gemma2-softcap-untied": ({"model": "tiny-gemma2", "lr": 1e-3, "tp": 2,
                                   "model_overrides": {"tie_word_embeddings": False}}, "vocab_parallel"),
    "chunked-ddp": ({"strategy": "ddp", "loss": "chunked"}, "chunked"),
    "chunked-fsdp": ({"strategy": "fsdp", "fsdp": {"sharding": "full"}, "loss": "chunked"}, "chunked"),
    "chunked-zero3": ({"strategy": "zero", "zero": {"stage": 3}, "loss": "chunked"}, "chunked"),
    "chunked-pp2": ({"pp": 2, "loss": "chunked"}, "chunked"),
}


def loss_form_plans() -> dict:
    """The cases above as plans (what test_parity_gloo adds to its batch of 2 processes)."""
    return {name: _plan(**fields, measure_steps=1) for name, (fields, _) in LOSS_FORM_CASES.items()}


def _world2_runs() -> dict:
    from test_parity_gloo import _runs

    return _runs(2)


def _head_matmuls_per_micro_batch(plan, out) -> float:
    """Rank-summed matmuls inside nn.Linear forwards on the warm-up step, per micro-batch, less the
    decoder blocks' (7 linears a Llama block): what the head ran (1 for the whole logits, else chunks)."""
    config = build_config(plan.model, plan.model_overrides)
    per_micro = sum(out["linear_matmul_dtypes"].values()) / (plan.grad_accum * (plan.num_workers // plan.pp))
    return per_micro - 7 * config.num_hidden_layers


@pytest.mark.integration
@pytest.mark.parametrize("name", list(LOSS_FORM_CASES))
def test_loss_form_trains_like_the_reference(name):
    plan, out = batch_result(_world2_runs()[("loss-form", name)])
    form = LOSS_FORM_CASES[name][1]
    assert out["loss_form"] == form
    if name.endswith("falls-back"):
        assert "tie_word_embeddings" in out["loss_form_fallback"]
    else:
        assert out["loss_form_fallback"] is None
    if form == "chunked" and plan.pp == 1:  # the head ran once per chunk of the micro-batch's tokens, not once
        config = build_config(plan.model, plan.model_overrides)
        tokens = plan.micro_batch * plan.seq_len
        chunks = tokens // loss_forms.chunk_tokens(tokens, config.vocab_size, config.hidden_size)
        assert _head_matmuls_per_micro_batch(plan, out) == chunks, out["linear_matmul_dtypes"]
    assert max_loss_difference(out["losses"], reference_for(plan)) < 1e-5, (out["losses"], reference_for(plan))
    assert out["losses"][-1] < out["losses"][0]


@pytest.mark.integration
@pytest.mark.parametrize("name", ["tp2", "tp2-sequence-parallel"])
def test_auto_is_vocab_parallel_under_tp(name):
    """test_parity_gloo's tp cases (loss auto) run the vocab-parallel loss (their parity is tested there)."""
    plan, out = batch_result(_world2_runs()[("model-parallel", name)])
    assert plan.loss == "auto" and (out["loss_form"], out["loss_form_fallback"]) == ("vocab_parallel", None)
    assert _head_matmuls_per_micro_batch(plan, out) == 1  # the head's logits in one matmul, not chunked

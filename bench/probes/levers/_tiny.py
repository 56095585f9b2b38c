"""What the lever probes share: a tiny Llama built from a config (no downloads), seeded, in train
mode with SDPA attention, and the selective-checkpointing policy (matmul and attention outputs
saved, the rest recomputed)."""
import torch
from torch.utils.checkpoint import CheckpointPolicy
from transformers import LlamaConfig, LlamaForCausalLM

aten = torch.ops.aten
SAVE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,  # what CPU dispatches (measured)
            aten._scaled_dot_product_efficient_attention.default,      # CUDA mem-efficient
            aten._scaled_dot_product_flash_attention.default,          # CUDA flash
            aten._scaled_dot_product_cudnn_attention.default}


def tiny_llama(vocab: int, hidden: int, ffn: int, layers: int, seq: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


def selective_policy(save_ops=frozenset(SAVE_OPS), seen: dict | None = None):
    """A create_selective_checkpoint_contexts policy: save `save_ops`' outputs, recompute the rest;
    `seen` (if given) records every op the policy was asked about and whether it saved it."""
    def policy(ctx, func, *args, **kwargs):
        save = func in save_ops
        if seen is not None:
            seen[str(func)] = save
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy

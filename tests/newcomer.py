"""What a newcomer brings on their first day, made locally (no hub): a small pretrained model folder
with its tokenizer (as `save_pretrained` writes them) and their own JSON-lines data."""

from __future__ import annotations

import json
from pathlib import Path

TEXTS = [f"note {i}: the quick brown fox jumps over the lazy dog, and the dog sleeps on." for i in range(300)]


def write_jsonl(path: Path, field: str = "text", texts: list[str] = TEXTS) -> Path:
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
    return path


def make_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on TEXTS, saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return folder


def make_pretrained(folder: Path, tokenizer: bool = True, vocab_size: int = 512) -> Path:
    """A tiny Llama saved with `save_pretrained` (config.json + model.safetensors), its tokenizer beside."""
    from paratune.model.build import build_config, build_model

    build_model(build_config("tiny-llama", {"vocab_size": vocab_size}), seed=3).save_pretrained(folder)
    if tokenizer:
        make_tokenizer(folder)
    return folder

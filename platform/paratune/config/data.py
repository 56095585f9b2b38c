"""Token batches: synthetic by default, or a local text / JSONL / Parquet file packed into fixed-length rows.

Every step has one global batch, a pure function of (seed, step). Data-parallel rank r trains
on its own slice of it, so data differs per rank, is deterministic, and the single-process
reference sees exactly the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from paratune.config.plan import DataSpec


class DataError(ValueError):
    """Data that cannot feed the model (missing file, too little text, tokens out of vocab)."""


class TokenBatches:
    """Global batches of shape [global_batch, seq_len] (labels = inputs; the model shifts)."""

    def __init__(self, spec: DataSpec, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.spec, self.vocab_size, self.seq_len = spec, vocab_size, seq_len
        self.global_batch_size, self.seed = global_batch, seed
        self._rows: torch.Tensor | None = None
        if spec.kind != "synthetic":
            self._rows = pack_rows(tokenize_file(spec, vocab_size), seq_len)

    def global_batch(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if self._rows is None:
            return synthetic_rows(gen, self.global_batch_size, self.seq_len, self.vocab_size)
        n = self._rows.shape[0]
        # A fresh seeded permutation per epoch; a step's rows continue where the last ended.
        ids = []
        for i in range(step * self.global_batch_size, (step + 1) * self.global_batch_size):
            epoch, pos = divmod(i, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            ids.append(int(perm[pos]))
        return self._rows[ids]

    def micro_batches(self, step: int, dp_rank: int, dp_degree: int, micro_batch: int) -> list[torch.Tensor]:
        """This rank's slice of the step's global batch, split into micro-batches."""
        batch = self.global_batch(step)
        per_rank = self.global_batch_size // dp_degree
        mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return list(mine.split(micro_batch))


class _RankSteps(torch.utils.data.Dataset):
    """Item i: one rank's micro-batches of step `first + i` (a DataLoader worker builds whole steps)."""

    def __init__(self, batches: TokenBatches, first: int, steps: int, dp_rank: int, dp_degree: int, micro_batch: int):
        self.batches, self.first, self.steps = batches, first, steps
        self.dp_rank, self.dp_degree, self.micro_batch = dp_rank, dp_degree, micro_batch

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> list[torch.Tensor]:
        return self.batches.micro_batches(self.first + i, self.dp_rank, self.dp_degree, self.micro_batch)


def step_loader(batches: TokenBatches, first: int, steps: int, dp_rank: int, dp_degree: int,
                micro_batch: int) -> Iterator[list[torch.Tensor]]:
    """This rank's micro-batches of steps first .. first + steps - 1, in order, through a torch
    DataLoader with the spec's workers and prefetch (the values are those of `micro_batches`:
    a step's rows are a pure function of (seed, step) whoever builds them)."""
    spec = batches.spec
    workers = spec.loader_workers
    loader = torch.utils.data.DataLoader(
        _RankSteps(batches, first, steps, dp_rank, dp_degree, micro_batch), batch_size=None, shuffle=False,
        num_workers=workers, prefetch_factor=spec.prefetch if workers else None,
        # fork would copy a process that runs gloo / NCCL threads (Ray workers): spawn is the safe start
        multiprocessing_context="spawn" if workers else None, persistent_workers=False)
    return iter(loader)


def synthetic_rows(gen: torch.Generator, rows: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Learnable synthetic text: arithmetic token sequences (random start and stride) + 10% noise."""
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    stride = torch.randint(1, 8, (rows, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq_len)) % vocab
    noise = torch.rand(rows, seq_len, generator=gen) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (rows, seq_len), generator=gen), tokens)


def _read_texts(spec: DataSpec) -> list[str]:
    path = Path(spec.path)  # type: ignore[arg-type]
    if not path.is_file():
        raise DataError(f"data.path: '{path}' is not a file")
    if spec.kind == "parquet":
        return _read_parquet_texts(path, spec.text_field)
    raw = path.read_text(encoding="utf-8", errors="replace")
    if spec.kind == "text":
        return [raw]
    texts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"data.path: {path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(spec.text_field), str):
            raise DataError(f"data.text_field: {path}:{number} has no string field '{spec.text_field}'")
        texts.append(record[spec.text_field])
    return texts


def _read_parquet_texts(path: Path, field: str) -> list[str]:
    """One column of a Parquet file (the layout HF datasets and most corpora ship in), read
    column-only: the other columns never leave the file."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid and OSError subclasses
        raise DataError(f"data.path: '{path}' is not a Parquet file ({type(err).__name__}: {err})") from None
    if field not in schema.names:
        raise DataError(f"data.text_field: '{field}' is not a column of {path}; columns: {', '.join(schema.names)}")
    column = pq.read_table(path, columns=[field]).column(field)
    texts = column.to_pylist()
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"data.text_field: {path} row {bad} of column '{field}' is {type(texts[bad]).__name__}, "
                        "not a string; allowed: a string column")
    return texts


def tokenize_file(spec: DataSpec, vocab_size: int) -> torch.Tensor:
    """One long token stream: documents joined by an end-of-text token."""
    texts = _read_texts(spec)
    if spec.tokenizer is None:
        if vocab_size < 257:
            raise DataError(f"data.tokenizer: byte-level tokens need vocab_size >= 257, model has {vocab_size}")
        eos, encode = 256, (lambda t: list(t.encode("utf-8")))
    else:
        from transformers import AutoTokenizer

        tok_dir = Path(spec.tokenizer)
        if not tok_dir.is_dir():
            raise DataError(f"data.tokenizer: '{tok_dir}' is not a local tokenizer directory")
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        encode = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    stream: list[int] = []
    for text in texts:
        stream.extend(encode(text))
        stream.append(eos)
    tokens = torch.tensor(stream, dtype=torch.long)
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise DataError(
            f"data.tokenizer: token id {int(tokens.max())} >= model vocab_size {vocab_size}; "
            "allowed: a tokenizer whose vocabulary fits the model"
        )
    return tokens


def pack_rows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Pack a token stream into full rows of seq_len (the ragged tail is dropped)."""
    n_rows = tokens.numel() // seq_len
    if n_rows < 1:
        raise DataError(f"data.path: {tokens.numel()} tokens, fewer than one row of seq_len {seq_len}")
    return tokens[: n_rows * seq_len].view(n_rows, seq_len)

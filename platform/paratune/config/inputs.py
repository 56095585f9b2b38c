"""What a plan reads from disk, checked where the command runs, before any worker starts.

The model (a preset, a config.json, or a folder that must hold its weights), the data file, the
field its records keep the text in, and the tokenizer with a vocabulary the model can embed: each
read in the cheapest way that proves it (JSON, the first record, a Parquet schema, the tokenizer's
own files), so `validate` and `plan` say what is wrong in seconds instead of a trial saying it
after Ray and its workers have started. Errors are PlanError lines: field, value, what is allowed.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratune.config.plan import DataSpec, Plan, PlanError, unknown_field_message


def check_inputs(plan: Plan, source: str = "plan") -> None:
    """Raise PlanError naming the first input of the plan that cannot be read as the plan says."""
    from paratune.config.model_config import ModelError, load_config_dict

    try:
        config = load_config_dict(plan.model, plan.model_overrides)
    except ModelError as err:
        raise PlanError(f"{source}: {err}") from None
    if plan.data.kind != "synthetic":
        _check_data(plan.data, source)
    if plan.data.tokenizer is not None:
        from paratune.config.sizes import config_sizes

        _check_tokenizer(plan.data, config_sizes(config).vocab, source)


def _check_data(spec: DataSpec, source: str) -> None:
    path = Path(spec.path)  # type: ignore[arg-type]
    if not path.is_file():
        where = "no such file" if not path.exists() else "not a file"
        raise PlanError(f"{source}: data.path: '{path}': {where}; allowed: a local {spec.kind} file")
    if spec.kind == "jsonl":
        record = _first_record(path, source)
        if not isinstance(record.get(spec.text_field), str):
            fields = [k for k, v in record.items() if isinstance(v, str)]
            what = "has no field" if spec.text_field not in record else "has a non-string field"
            raise PlanError(f"{source}: data.text_field: '{spec.text_field}': the first record of {path} {what} "
                            f"'{spec.text_field}'; {unknown_field_message(spec.text_field, fields)}")
    elif spec.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid and OSError subclasses
            raise PlanError(f"{source}: data.path: '{path}' is not a Parquet file ({type(err).__name__})") from None
        if spec.text_field not in names:
            raise PlanError(f"{source}: data.text_field: '{spec.text_field}' is not a column of {path}; "
                            f"{unknown_field_message(spec.text_field, names)}")


def _first_record(path: Path, source: str) -> dict:
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PlanError(f"{source}: data.path: {path}:{number}: not JSON ({err.msg}); allowed: one JSON "
                                "object per line") from None
            if not isinstance(record, dict):
                raise PlanError(f"{source}: data.path: {path}:{number}: a {type(record).__name__}, not an object; "
                                "allowed: one JSON object per line")
            return record
    raise PlanError(f"{source}: data.path: {path} holds no record; allowed: one JSON object per line")


def tokenizer_vocab_size(folder: Path) -> int | None:
    """The number of ids a tokenizer folder can produce, from its own files (tokenizer.json's
    model vocabulary and added tokens, or vocab.json + added_tokens.json); None when neither is there
    (a sentencepiece-only tokenizer: the trial's check, after tokenizing, still holds)."""
    fast = folder / "tokenizer.json"
    if fast.is_file():
        data = json.loads(fast.read_text())
        vocab = (data.get("model") or {}).get("vocab")
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab or [])))
        ids += [t.get("id", -1) for t in data.get("added_tokens") or []]
        return max(ids) + 1 if ids else None
    slow = folder / "vocab.json"
    if slow.is_file():
        ids = list(json.loads(slow.read_text()).values())
        added = folder / "added_tokens.json"
        if added.is_file():
            ids += list(json.loads(added.read_text()).values())
        return max(ids) + 1 if ids else None
    return None


def _check_tokenizer(spec: DataSpec, vocab_size: int, source: str) -> None:
    folder = Path(spec.tokenizer)  # type: ignore[arg-type]
    if not folder.is_dir():
        where = "no such folder" if not folder.exists() else "not a folder"
        raise PlanError(f"{source}: data.tokenizer: '{folder}': {where}; allowed: a local tokenizer folder (what "
                        "tokenizer.save_pretrained writes; never a hub name)")
    ids = tokenizer_vocab_size(folder)
    if ids is not None and vocab_size and ids > vocab_size:
        raise PlanError(f"{source}: data.tokenizer: '{folder}' has {ids:,} token ids, more than the model's vocab_size "
                        f"{vocab_size:,}; allowed: a tokenizer whose ids the model embeds (the model's own, or "
                        f"model_overrides.vocab_size >= {ids})")


def check_space_inputs(plans, source: str) -> None:
    """`check_inputs` for each distinct input set among a space's plans (model, overrides, data:
    usually one), so a sweep with a bad path stops before Ray starts."""
    seen: set[str] = set()
    for plan in plans:
        key = json.dumps([plan.model, plan.model_overrides, plan.data.model_dump(mode="json")], sort_keys=True,
                         default=str)
        if key not in seen:
            seen.add(key)
            check_inputs(plan, source)

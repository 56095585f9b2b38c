"""`paratune models` and `paratune spaces`: what ships with paratune (model presets, search spaces), and
which optional extras this install has."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from paratune.levers import levers


def cmd_models(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from paratune.model.build import build_config, parameter_counts
    from paratune.config.model_config import preset_names

    table = Table(title="model presets (random init from config; never downloaded)")
    # "active params": N in 6N, what a token's matmuls touch (MoE: the routed top-k experts only).
    for col in ("preset", "type", "layers", "hidden", "heads/kv", "params", "active params"):
        table.add_column(col)
    for name in preset_names():
        cfg = build_config(name)
        counts = parameter_counts(cfg)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # GPT-NeoX, OPT: no GQA
        table.add_row(name, cfg.model_type, str(cfg.num_hidden_layers), str(cfg.hidden_size),
                      f"{cfg.num_attention_heads}/{kv_heads}",
                      f"{counts['total'] / 1e6:,.1f}M", f"{counts['compute'] / 1e6:,.1f}M")
    console.print(table)
    return 0


def _extras_of(raw: dict) -> list[str]:
    """The extras a space's plans may need (read from its YAML, no plan built): zero, the levers' (float8), peft."""
    fixed, space = raw.get("fixed") or {}, raw.get("space") or {}
    needs = []
    if "zero" in (space.get("strategy") or {}):
        needs.append("deepspeed")
    for lever in levers():  # a lever's fields off their defaults, fixed or swept
        if lever.extra and any(v not in (None, f.default) for f in lever.fields
                               for v in [fixed.get(f.name), *(space.get(f.name) or [])]):
            needs.append(lever.extra)
    if fixed.get("peft"):
        needs.append("lora")
    return needs


def cmd_spaces(args: argparse.Namespace, console: Console) -> int:
    """The shipped spaces (name, model, workers, what they sweep, the extras their plans need), or
    one of them printed as YAML (`paratune spaces local_cpu > my_space.yaml`, to adapt)."""
    import yaml
    from rich.table import Table

    from paratune.config.extras import install_hint, installed
    from paratune.sweep.space import SHIPPED_SPACES, SpaceError, resolve_space, shipped_spaces

    if args.name:
        try:
            path = resolve_space(args.name)
        except SpaceError as err:
            console.print(f"[red]{escape(str(err))}[/red]")
            return 2
        print(path.read_text(), end="")
        return 0
    table = Table(title=f"shipped search spaces ({SHIPPED_SPACES})")
    for col in ("name", "model", "workers", "strategies", "extras", "description"):
        table.add_column(col, overflow="fold")
    missing: set[str] = set()
    for name, path in shipped_spaces().items():
        raw = yaml.safe_load(path.read_text()) or {}
        fixed = raw.get("fixed") or {}
        needs = _extras_of(raw)
        missing.update(e for e in needs if not installed(e))
        extras = ", ".join(e if installed(e) else f"{e} (not installed)" for e in needs) or "-"
        table.add_row(name, str(fixed.get("model", "")), str(fixed.get("num_workers", "")),
                      ", ".join((raw.get("space") or {}).get("strategy") or {}), extras,
                      escape(str(raw.get("description", ""))))
    console.print(table)
    console.print("use one by name:  paratune plan local_cpu  |  paratune tune local_cpu  |  "
                  "paratune spaces local_cpu > my_space.yaml (to adapt)", soft_wrap=True)
    for extra in sorted(missing):
        console.print(f"[yellow]{extra} is not installed here: the plans that need it are dropped from a sweep "
                      f"(by rule, counted); {escape(install_hint(extra))}[/yellow]", soft_wrap=True)
    return 0

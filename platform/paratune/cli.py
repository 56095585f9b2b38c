"""`paratune init | plan | tune | trial | train | report | profile | ui | validate | models | spaces`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from paratune.config.plan import PlanError, load_plan


def _say_ray_fallbacks(console: Console) -> None:
    """What the installed Ray lacks and what paratune does instead (paratune.cluster.launch.RayFeatures), once."""
    from paratune.cluster.launch import ray_features

    features = ray_features()
    for line in features.lost():
        console.print(f"[dim]ray {features.version}: {escape(line)}[/dim]", soft_wrap=True)


def _cmd_trial(args: argparse.Namespace, console: Console) -> int:
    """Run plans one after another. No plan or model, however broken, ends the command: a bad one
    is a failed row with its reason, and the results so far are written after every plan."""
    from paratune.trial.failures import classify
    from paratune.sweep.parity import winner_parity
    from paratune.out.tables import print_results
    from paratune.trial.results import TrialResult
    from paratune.cluster.trial import run_trial

    rows: list[tuple[str, TrialResult, float | None]] = []
    passed: dict[int, bool] = {}  # row index -> the parity judge's verdict (--parity, ok trials only)

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(
                [{"name": n, "parity_max_abs_diff": d, "parity_passed": passed.get(i), **r.model_dump()}
                 for i, (n, r, d) in enumerate(rows)], indent=2))

    _say_ray_fallbacks(console)
    for i, path in enumerate(args.plans, 1):
        name = Path(path).stem
        try:
            plan = load_plan(path)
            if args.workers:
                plan = plan.with_changes(num_workers=args.workers)
        except PlanError as err:
            console.print(f"[red]{name}: invalid plan[/red]\n{escape(str(err))}")
            rows.append((name, TrialResult.failed({}, "invalid_config", str(err)), None))
            save()
            continue
        with console.status(f"trial {i}/{len(args.plans)}: {name} ({plan.strategy}, {plan.num_workers} workers)"):
            try:
                result = run_trial(plan)
            except Exception as err:  # noqa: BLE001 - run_trial should not raise; if it does, record it
                reason, message = classify(err)
                result = TrialResult.failed(plan, reason, message)
        diff = None
        if result.ok and args.parity:
            # The sweep's judge (paratune.sweep.parity): its tolerance, and a proxy for a model too big to
            # train on this CPU. It never raises: a check that cannot run says why.
            with console.status(f"single-process reference for {name}"):
                check = winner_parity(plan, result)
            passed[len(rows)] = check.passed
            if math.isfinite(check.max_abs_loss_diff):
                diff = check.max_abs_loss_diff
            if check.proxy:
                console.print(f"{name}: loss parity judged on a proxy of the model (too big for a reference "
                              "on this CPU)")
            if check.mode == "deterministic":
                console.print(f"{name}: loss parity judged with {escape(', '.join(check.switched_off))} off on both "
                              "sides (random draws no two layouts repeat); the measured steps kept them")
            if not check.passed:
                what = "fails loss parity" if diff is not None else "no parity"
                console.print(f"[red]{name}: {what} ({escape(check.reason)[:300]})[/red]")
        verdict = f"{result.tokens_per_s_per_gpu:,.0f} tokens/s/GPU" if result.ok else f"{result.reason}"
        console.print(f"[bold]{name}[/bold]: {result.status} ({verdict})"
                      + (f" [dim]from {escape(result.model_init)}[/dim]" if result.model_init else ""))
        rows.append((name, result, diff))
        save()
    print_results(rows, console)
    if args.json:
        console.print(f"results written to {args.json}")
    return 0 if all(r.ok for _, r, _ in rows) else 1


def _cmd_tune(args: argparse.Namespace, console: Console) -> int:
    from paratune.sweep.space import SpaceError, load_space
    from paratune.sweep.driver import run_sweep
    from paratune.sweep.ledger import SweepError
    from paratune.out.tables import print_sweep
    from paratune.out.tracking import default_tracking_uri

    from paratune.config.inputs import check_space_inputs

    try:
        space = load_space(args.space)
        check_space_inputs((c.plan for c in space.candidates), source=args.space)  # before Ray starts
    except (SpaceError, PlanError) as err:
        console.print(f"[red]invalid space[/red]\n{escape(str(err))}")
        return 2
    search = args.search
    if args.train_loop:  # every plan runs the user's loop (paratune.trial.user_loop); checked before any launch
        from paratune.sweep.space import with_train_loop
        from paratune.config.train_loop import TrainLoopError

        try:
            space = with_train_loop(space, args.train_loop)
        except (TrainLoopError, SpaceError) as err:
            console.print(f"[red]{escape(str(err))}[/red]")
            return 2
        # The calibrated searcher profiles paratune's own model, not the loop's: grid unless asked.
        search = search or ("grid" if space.spec.search.algorithm == "calibrated" else None)
    from paratune.config.home import paratune_home

    _say_ray_fallbacks(console)
    out = Path(args.out) if args.out else paratune_home() / space.spec.name
    try:
        outcome = run_sweep(space, out, trials=args.trials, algorithm=search, seed=args.seed,
                            resume=args.resume, tracking_uri=args.tracking_uri, console=console, verbose=args.verbose)
    except SweepError as err:
        console.print(f"[red]{err}[/red]")
        return 2
    print_sweep(outcome, console)
    from paratune.out.export import own_command

    uri = args.tracking_uri or default_tracking_uri()
    console.print(f"compare the trials in MLflow:  {own_command()} ui --tracking-uri {uri}", soft_wrap=True)
    # Last, so it is what the terminal ends on (make demo).
    if outcome.report_path is not None:
        console.print(f"sweep report: [bold]{outcome.report_path}[/bold]", soft_wrap=True)
    else:
        console.print(f"no sweep report (see above); write it again with:  {own_command()} report {outcome.out_dir}")
    return 0 if outcome.verdict and outcome.verdict.winner else 1


def _cmd_report(args: argparse.Namespace, console: Console) -> int:
    """(Re)write a sweep's report from its folder, and log it to the sweep's parent run when the
    MLflow store recorded in sweep.json can be reached (a missing SQLite file is not created)."""
    from paratune.sweep.finish import write_page

    sweep_dir = Path(args.sweep_dir).resolve()
    if not (sweep_dir / "ledger.jsonl").exists() and not (sweep_dir / "sweep.json").exists():
        console.print(f"[red]{sweep_dir}: not a sweep folder (no ledger.jsonl or sweep.json)[/red]")
        return 2
    try:
        state = json.loads((sweep_dir / "sweep.json").read_text())
    except (OSError, json.JSONDecodeError):
        state = {}
    tracker, parent = None, state.get("parent_run_id")
    uri = args.tracking_uri or state.get("tracking_uri")
    if uri and parent:
        tracker = _reachable_tracker(uri, parent, console)
    path = write_page(sweep_dir, tracker, parent if tracker else None, console)
    return 0 if path is not None else 1  # write_page printed the path, or why there is none


def _reachable_tracker(uri: str, parent: str, console: Console):
    """A SweepTracker on `uri` if the parent run is there (a few seconds at most), else None, said why."""
    import os

    from paratune.out.tracking import SweepTracker

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        console.print(f"[yellow]MLflow store {uri} is not there: the report is not logged to MLflow[/yellow]")
        return None
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a server that is down: say so now
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    try:
        tracker = SweepTracker(uri)
        tracker.client.get_run(parent)
        return tracker
    except Exception as err:  # noqa: BLE001 - the report is still written, only not logged
        console.print(f"[yellow]MLflow ({uri}) unreachable or without the sweep's run ({type(err).__name__}: "
                      f"{escape(str(err))[:300]}): the report is not logged to MLflow[/yellow]")
        return None


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from paratune.train.training import run_training

    plan = _load_plan_or_say_why(args.plan, console)
    if plan is None:
        return 2
    if args.workers:
        plan = plan.with_changes(num_workers=args.workers)
    _say_ray_fallbacks(console)
    result = run_training(plan, steps=args.steps, checkpoint_every=args.checkpoint_every,
                          max_failures=args.max_failures, name=args.name, tracking_uri=args.tracking_uri,
                          storage_path=args.storage, hf_out=args.hf_out)
    if result.ok:
        restarts = f", resumed at step(s) {result.resumed_at_steps}" if result.resumed_at_steps else ""
        console.print(f"trained {result.name}: {result.steps} steps, final loss {result.losses[-1]:.4f}, "
                      f"{result.tokens_per_s_per_gpu or 0:,.0f} tokens/s/GPU{restarts}")
        console.print(f"last checkpoint: {result.checkpoint}")
        if result.hf_model:
            console.print(f"trained model (AutoModelForCausalLM.from_pretrained): {result.hf_model}")
        else:
            console.print(f"[yellow]no Hugging Face folder[/yellow]: {escape(result.hf_model_note or '')}")
    else:
        console.print(f"[red]training {result.name} failed ({result.reason})[/red]: {escape(result.message or '')}")
        console.print(f"run it again with --name {result.name} to continue from its last checkpoint")
    if args.json:
        Path(args.json).write_text(result.model_dump_json(indent=1))
    return 0 if result.ok else 1


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    import time

    from paratune.config.devices import get_device
    from paratune.costs.estimate import estimate_space
    from paratune.out.tables import print_estimates
    from paratune.config.inputs import check_space_inputs
    from paratune.config.plan import absolute_local_paths
    from paratune.sweep.space import SpaceError, read_space_mapping, resolve_space, space_from_dict

    try:
        args.space = str(resolve_space(args.space))  # a file, or a shipped space's name (--compare too)
    except SpaceError as err:
        console.print(f"[red]cannot plan[/red]\n{escape(str(err))}")
        return 2
    if args.compare:  # which cluster to train on (paratune.commands.compare); without it, nothing below changes
        from paratune.commands.compare import cmd_compare

        return cmd_compare(args, console)
    t0 = time.perf_counter()
    profiles = None
    if args.profile:
        from paratune.costs.profile import ProfileError, load_profiles

        try:
            profiles = load_profiles(args.profile)
        except ProfileError as err:
            console.print(f"[red]cannot plan[/red]\n{escape(str(err))}")
            return 2
        if not profiles:
            console.print(f"[red]cannot plan[/red]\nprofile: {args.profile} holds no profile")
            return 2
    try:
        raw = read_space_mapping(args.space)  # a plan file (plans/*.yaml): a space of one plan
        device_name, why = (args.device, "--device") if args.device else _space_device(raw, profiles, args.devices)
        device = get_device(device_name, args.devices)
        fixed = dict(raw.get("fixed") or {})
        gpus = args.gpus_per_node or device.gpus_per_node
        if args.nodes:
            fixed.update(num_workers=args.nodes * gpus, gpus_per_node=gpus)
        fixed = absolute_local_paths(fixed, Path(args.space).resolve().parent)  # as a space or plan file reads them
        space = space_from_dict({**raw, "fixed": fixed}, source=Path(args.space))
        check_space_inputs((c.plan for c in space.candidates), source=args.space)
    except (SpaceError, ValueError) as err:
        console.print(f"[red]cannot plan[/red]\n{escape(str(err))}")
        return 2
    budget = space.spec.objective.memory_budget_gb
    capacity = min(device.memory_gib, budget) if budget else None  # the budget is per rank, in GiB
    try:
        estimates = estimate_space(space, device, capacity_gib=capacity, margin=args.margin,
                                   activation_model="formula" if args.formula else "trace",
                                   routing_balance=args.routing_balance)
    except ValueError as err:  # a routing balance below 1
        console.print(f"[red]cannot plan[/red]\n{escape(str(err))}")
        return 2
    notes: list[str] = []
    if profiles:
        from paratune.costs.timemodel import StepTimeModel

        estimates, notes = _times_from_profiles(estimates, space, StepTimeModel(profiles))
    first = space.candidates[0].plan
    console.print(f"device: {device.name} ({why}{'' if args.device else '; --device to predict another'})")
    console.print(space.pruning_report())
    print_estimates(estimates, device, console, top=args.top,
                    title=f"{space.spec.name}: {first.model}, {first.num_workers} x {device.name} "
                          f"({first.num_workers // (first.gpus_per_node or first.num_workers)} node(s)), "
                          "predicted, in launch order",
                    **({"time_source": f"composed from the stored profile {args.profile} (paratune.costs.timemodel)"}
                       if profiles else {}))
    from paratune.out.tables import print_construction, print_float8_coverage

    print_construction(estimates, console, args.top)
    _print_levers(estimates, device, console, args.top)
    _print_experts(estimates, device, console, args.top, args.routing_balance)
    print_float8_coverage([e.plan for e in estimates], console)
    if profiles:
        _print_time_parts(estimates, profiles, console, args.top)
        for note in notes:
            console.print(f"[yellow]{escape(note)}[/yellow]")
    _hint_buffer_sizes(estimates, raw, console)
    console.print(f"{len(estimates)} plans estimated in {time.perf_counter() - t0:.1f} s")
    if args.json:
        from paratune.costs.risk import plan_fit_probability

        Path(args.json).write_text(json.dumps(
            [{"plan": e.plan.to_dict(), "fits": e.fits, "tight": e.tight, "measurable": e.measurable,
              "overflow": e.overflow, **e.summary(), "predicted_fit_probability": plan_fit_probability(e),
              **({"predicted_step_parts_s": e.time_parts} if profiles else {})} for e in estimates],
            indent=1))
    return 0 if any(e.measurable for e in estimates) else 1


def _space_device(raw: dict, profiles, extra: str | None) -> tuple[str, str]:
    """The device `plan` predicts on when --device is not given, and why: the space's own (its
    estimate.device, else its plans' device: cpu, or the table's default GPU for cuda), else this
    machine's (its GPU in the table, or the CPU)."""
    if profiles:
        return ("cpu", "the profile's") if profiles[0].device_type == "cpu" else ("h100-80gb", "the default GPU")
    named = (raw.get("estimate") or {}).get("device")
    if named and named != "auto":
        return named, "the space's estimate.device"
    device = (raw.get("fixed") or raw).get("device", "auto")
    if device == "cpu":
        return "cpu", "the space's device"
    if device == "cuda":
        return "h100-80gb", "the space's device is cuda: the table's default GPU"
    import torch

    if not torch.cuda.is_available():
        return "cpu", "the space's device is auto and this machine has no GPU"
    from paratune.config.devices import gpu_model, load_devices

    model = gpu_model(torch.cuda.get_device_name())
    match = next((d.name for d in load_devices(extra).values() if model and d.gpu == model.key), None)
    return (match, "this machine's GPU") if match else ("h100-80gb", "this machine's GPU is not in the table")


def _hint_buffer_sizes(estimates, raw: dict, console: Console) -> None:
    """ZeRO's reduce / all-gather buckets are sized in elements, not by the model (DeepSpeed's 5e8
    default is 1.9 GiB of fp32 whatever the model): where they outweigh the model's own states
    and the space leaves them unset, say which to set and a size that scales with the model
    (hidden_size squared: what Hugging Face's DeepSpeed integration puts for `auto`)."""
    zero = [e for e in estimates if e.plan.strategy == "zero"]
    swept = ((raw.get("space") or {}).get("strategy") or {}).get("zero") or {}
    fixed = (raw.get("fixed") or {}).get("zero") or {}
    if not zero or any(k in swept or k in fixed for k in ("reduce_bucket_size", "allgather_bucket_size")):
        return
    worst = max(zero, key=lambda e: e.memory.comm_buffers)
    states = worst.memory.weights + worst.memory.gradients + worst.memory.optimizer
    if worst.memory.comm_buffers <= states:
        return
    from paratune.model.build import build_config

    hidden = int(getattr(build_config(worst.plan.model, worst.plan.model_overrides), "hidden_size", 0) or 0)
    size = f"{max(hidden * hidden, 1):.0e}".replace("e+0", "e").replace("e+", "e")
    console.print(f"[yellow]ZeRO's buffers ({worst.memory.comm_buffers / 2**30:.2f} GiB) outweigh the model's states "
                  f"({states / 2**30:.2f} GiB): DeepSpeed's default buckets are 5e8 elements whatever the model. Set "
                  f"zero.reduce_bucket_size and zero.allgather_bucket_size in the space (e.g. {size}, hidden_size "
                  "squared, Hugging Face's `auto`).[/yellow]")


def _print_experts(estimates, device, console: Console, top: int, routing_balance: float | None) -> None:
    """`paratune plan` of an expert-parallel space: each fitting ep plan's expert layout, its
    all-to-all and where it runs (paratune.costs.moe)."""
    from rich.table import Table

    from paratune.costs.moe import DEFAULT_IMBALANCE, all_to_all_crosses_nodes, expert_layout, expert_share
    from paratune.out.tables import strategy_label

    shown = [e for e in estimates if e.measurable and e.plan.ep > 1][:top]
    if not shown:
        return
    table = Table(title="expert parallelism: experts per rank, their copies, the all-to-all")
    for col in ("#", "plan", "experts/rank", "expert_dp", "expert params/rank (M)", "all-to-all GB/step", "all-to-all over"):
        table.add_column(col, justify="left" if col in ("plan", "all-to-all over") else "right")
    for i, e in enumerate(shown, 1):
        layout, share = expert_layout(e.plan), expert_share(e.plan)
        per_node = e.plan.gpus_per_node or device.gpus_per_node
        table.add_row(str(i), strategy_label(e.plan.to_dict()), f"{layout.experts // e.plan.ep} of {layout.experts}",
                      str(share.expert_dp), f"{share.local / 1e6:,.0f}", f"{e.comm.ep / 1e9:.1f}",
                      "nodes (inter-node links)" if all_to_all_crosses_nodes(e.plan, per_node) else "one node (NVLink)")
    console.print(table)
    balance = routing_balance or DEFAULT_IMBALANCE
    console.print(f"routing balance (max / mean tokens per expert): {balance:g}"
                  + (" (measured, --routing-balance)" if routing_balance else
                     " assumed (ideal; a trial's routing_balance, --routing-balance X, replaces it)"))


def _times_from_profiles(estimates, space, predictor) -> tuple[list, list[str]]:
    """Each estimate once per env choice of the space, its step time (and its parts) from
    `predictor` (a paratune.costs.predict.TimePredictor: the profiles' StepTimeModel, which takes the
    profile of that env) instead of the roofline; fastest first among those that fit."""
    from dataclasses import replace

    out, notes = [], set()
    for e in estimates:
        for env in space.env_grid():
            plan = e.plan.with_changes(env={**e.plan.env, **env}, grad_accum=e.plan.grad_accum) if env else e.plan
            pred = predictor.predict(plan)
            if pred.note:
                notes.add(pred.note)
            out.append(replace(e, plan=plan, time=pred.time_estimate(), time_parts=pred.parts))
    out.sort(key=lambda e: (not e.measurable, -e.time.tokens_per_s_per_gpu if e.measurable else e.memory.total))
    return out, sorted(notes)


def _print_time_parts(estimates, profiles, console: Console, top: int) -> None:
    """`paratune plan --profile`: where each fitting plan's predicted step goes."""
    from rich.table import Table

    from paratune.out.tables import env_label, strategy_label

    table = Table(title="step time from the profile (s): compute, exposed communication, optimizer, overheads")
    for col in ("#", "plan", "env", "compute", "tp", "pp", "dp", "ep", "optimizer", "other", "step s"):
        table.add_column(col, justify="left" if col in ("plan", "env") else "right")
    for i, e in enumerate([e for e in estimates if e.measurable][:top], 1):
        parts = e.time_parts
        known = ("compute", "tp_comm", "pp_comm", "dp_comm", "ep_comm", "optimizer")
        other = sum(v for k, v in parts.items() if k not in known)
        env = env_label(e.plan.env) or "-"
        table.add_row(str(i), strategy_label(e.plan.to_dict()), env, *(f"{parts.get(k, 0.0):.3f}" for k in known),
                      f"{other:.3f}", f"{e.time.step_s:.3f}")
    console.print(table)
    p = profiles[0]
    console.print(f"time: composed from {len(profiles)} profile(s) measured on {p.device_name} "
                  f"({p.world_size} workers; {p.created_at}), not fitted to any trial yet "
                  "(a sweep refits it on its measured trials)")


def _print_levers(estimates, device, console: Console, top: int) -> None:
    """`paratune plan`: what the throughput levers change in the plans shown above, where any is
    set: the logits a rank holds by the loss's form (one fp32 buffer of them; the loss keeps a few),
    the FLOPs recomputed, the FLOPs float8 moves to the FP8 peak, and MFU against bf16's peak."""
    from rich.table import Table

    from paratune.costs.activations import vocab_held
    from paratune.costs.efficiency import float8_flops_share, recompute_share
    from paratune.levers import loss_form
    from paratune.model.shapes import float8_cast_bytes, model_shape
    from paratune.out.tables import strategy_label

    shown = [e for e in estimates if e.measurable][:top]
    if not any(e.plan.activation_checkpointing != "none" or e.plan.compile or e.plan.float8 != "none"
               or loss_form(e.plan) != "standard" or e.plan.async_tp for e in shown):
        return
    table = Table(title="levers: logits GiB per rank (one fp32 buffer, by the loss's form), recomputed FLOPs, "
                        "float8's share of the FLOPs, predicted MFU against the bf16 peak")
    for col in ("#", "plan", "loss", "logits GiB", "fp8 casts GiB", "recomputed", "fp8 FLOPs", "MFU (bf16 peak)"):
        table.add_column(col, justify="left" if col in ("plan", "loss") else "right")
    for i, e in enumerate(shown, 1):
        shape = model_shape(e.plan)
        tokens = e.plan.micro_batch * e.plan.seq_len // e.plan.cp
        logits = 4.0 * tokens * vocab_held(e.plan, shape.vocab, shape.hidden)
        f8 = float8_flops_share(e.plan, shape) if "fp8" in device.tflops else 0.0
        mfu = f"{e.mfu_vs_bf16_peak:.1%}" if e.mfu_vs_bf16_peak else "-"
        table.add_row(str(i), strategy_label(e.plan.to_dict()), loss_form(e.plan), f"{logits / 2**30:.2f}",
                      f"{float8_cast_bytes(e.plan, shape) / 2**30:.2f}", f"{recompute_share(e.plan, shape):.1%}",
                      f"{f8:.0%}", mfu)
    console.print(table)
    console.print("levers in the roofline (paratune.costs.efficiency): recompute adds its FLOPs and the forward's "
                  "memory traffic; float8's linears at torchao's measured speed-up; compile fuses the memory-bound "
                  "ops between matmuls; async TP hides the forward's tp collectives (levers.async_tp_hidden); "
                  "compile changes no memory")


def _load_plan_or_say_why(path: str, console: Console):
    """The plan, or None after printing what is wrong with it (field, value, what is allowed)."""
    try:
        return load_plan(path)
    except PlanError as err:
        console.print(f"[red]invalid plan[/red]\n{escape(str(err))}")
        return None


def _cmd_validate(args: argparse.Namespace, console: Console) -> int:
    """Every rule a trial checks before launch (paratune.checks.refusals; its files included): seconds, no Ray."""
    from paratune.config.model_config import ModelError
    from paratune.checks.refusals import check_plan

    plan = _load_plan_or_say_why(args.plan, console)
    if plan is None:
        return 2
    try:
        check_plan(plan, inputs_source=args.plan)
    except (PlanError, ModelError) as err:
        console.print(f"[red]invalid plan[/red]\n{escape(str(err))}")
        return 2
    console.print(plan.to_yaml())
    from paratune.out.tables import print_float8_coverage

    print_float8_coverage([plan], console, comment=True)
    return 0


def _cmd_init(args: argparse.Namespace, console: Console) -> int:
    """A starter space for the model on the hardware at hand (paratune.commands.starter), written and named."""
    from paratune.out.export import own_command
    from paratune.commands.starter import InitError, find_hardware, starter_space

    try:
        hw = find_hardware(args.device, args.gpus, args.devices)
        with console.status(f"predicting {args.model}'s plans on {hw.workers} x {hw.device}"):
            text = starter_space(args.model, hw, lora=args.lora, data=args.data, text_field=args.text_field,
                                 seq_len=args.seq_len, devices_file=args.devices)
    except (InitError, ValueError) as err:
        console.print(f"[red]cannot make a space[/red]\n{escape(str(err))}")
        return 2
    name = text.split("\nname: ", 1)[1].split("\n", 1)[0]
    out = Path(args.out or f"{name}.yaml")
    out.write_text(text)
    console.print(f"wrote {out} for {hw.workers} x {hw.device} ({escape(hw.where)})")
    console.print(f"next:  {own_command()} plan {out}\n       {own_command()} tune {out}", soft_wrap=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from paratune.config.quiet import quiet

    quiet()  # known-harmless third-party lines, filtered before anything emits them (paratune.config.quiet)
    parser = argparse.ArgumentParser(prog="paratune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trial", help="run plan(s) as measured Ray Train trials, results side by side")
    p.add_argument("plans", nargs="+", help="plan YAML file(s)")
    p.add_argument("--workers", type=int, help="override num_workers")
    p.add_argument("--parity", action="store_true", help="also compare losses to a single-process reference")
    p.add_argument("--json", help="write the results to this JSON file")
    p = sub.add_parser("tune", help="sweep a search space with Ray Tune + Optuna; MLflow; export the winner")
    p.add_argument("space", help="search space YAML, or a shipped space's name (paratune spaces)")
    p.add_argument("--trials", type=int, help="trial budget (default: the space's search.trials)")
    p.add_argument("--search", choices=["calibrated", "tpe", "random", "grid"], help="search algorithm (default: the space's)")
    p.add_argument("--seed", type=int, help="searcher seed (default: the space's)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep in --out")
    p.add_argument("--out", help="sweep folder (default: $PARATUNE_HOME or ./paratune_runs, /<space name>)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--verbose", action="store_true", help="also Ray Tune's own output (banner, result folder, "
                                                          "trial tables)")
    p.add_argument("--train-loop", metavar="MODULE:FUNCTION",
                   help="your own Ray Train loop, timed and swept like paratune's (paratune.trial.user_loop)")
    p = sub.add_parser("report", help="(re)write a sweep's report (report/report.html) and log it to its MLflow run")
    p.add_argument("sweep_dir", help="the sweep folder (tune --out)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: the one in the sweep's sweep.json)")
    p = sub.add_parser("train", help="train with a plan (e.g. a winner): checkpoints, resumes after faults")
    p.add_argument("plan", help="plan YAML (e.g. <sweep>/winner/plan.yaml)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps to train")
    p.add_argument("--checkpoint-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--max-failures", type=int, default=3, help="worker-group restarts from the last checkpoint")
    p.add_argument("--name", help="run name; the same name again resumes from its last checkpoint")
    p.add_argument("--workers", type=int, help="override num_workers")
    p.add_argument("--storage", help="checkpoint storage (default: $PARATUNE_STORAGE or $PARATUNE_HOME/ray)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--hf-out", help="also copy the trained model's Hugging Face folder here (it is always in the "
                                    "last checkpoint, under hf_model/)")
    p.add_argument("--json", help="write the result to this JSON file")
    p = sub.add_parser("plan", help="predict memory, communication and speed of a space's plans (no GPU needed)")
    p.add_argument("space", help="search space or plan YAML, or a shipped space's name (paratune spaces)")
    p.add_argument("--device", help="device from the table (see --devices; default h100-80gb, or cpu with a CPU "
                   "--profile)")
    p.add_argument("--devices", help="a JSON/YAML file adding or overriding devices")
    p.add_argument("--nodes", type=int, help="nodes (sets num_workers = nodes x gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the device's)")
    p.add_argument("--margin", type=float, default=0.0, help="fraction over capacity tolerated before rejecting")
    p.add_argument("--formula", action="store_true", help="activations from DESIGN.md's formula, not a trace")
    p.add_argument("--routing-balance", type=float, help="MoE routing's max / mean tokens per expert (a trial's "
                   "measured routing_balance; default 1.0, ideal): scales the busiest rank's expert compute, "
                   "all-to-all and received activations under ep")
    p.add_argument("--top", type=int, default=20, help="rows of fitting plans to print")
    p.add_argument("--json", help="write every estimate to this JSON file")
    p.add_argument("--profile", help="step times from this stored profile (paratune profile --out FILE), not the roofline")
    p.add_argument("--compare", metavar="DEVICE:GPUS,...", help="which cluster to train on: the best plan, time, GPU-hours "
                   "and cost to train --tokens on each (e.g. h100-80gb:8,a100-80gb:16), the Pareto front, a figure")
    p.add_argument("--tokens", type=float, help="with --compare: tokens to train (e.g. 1e11)")
    p.add_argument("--prices", help="with --compare: YAML {currency: USD, <device>: <price per GPU-hour>}")
    p.add_argument("--out", help="with --compare: folder for compare.json and compare.png (a sweep's folder: its "
                   "report draws them; default $PARATUNE_HOME/compare-<space>)")
    p = sub.add_parser("profile", help="measure what a space's plans need on the cluster (blocks, collectives, "
                                       "optimizer) for `plan --profile` and the sweep's time model")
    p.add_argument("space", help="search space YAML, or a shipped space's name (paratune spaces)")
    p.add_argument("--out", help="also write the profiles (a JSON list) to this file")
    p.add_argument("--store", help="profile store folder (default: $PARATUNE_HOME/profiles)")
    p.add_argument("--reps", type=int, help="timed repetitions per measurement (default 4)")
    p.add_argument("--force", action="store_true", help="measure again even if a stored profile covers the plans")
    p = sub.add_parser("ui", help="open the MLflow UI on the sweep store (127.0.0.1)")
    p.add_argument("--tracking-uri")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p = sub.add_parser("validate", help="check a plan file and print it with derived fields")
    p.add_argument("plan")
    sub.add_parser("models", help="list model presets and their parameter counts")
    p = sub.add_parser("spaces", help="list the shipped search spaces (plan, tune and profile take one by name)")
    p.add_argument("name", nargs="?", help="print this shipped space's YAML (to copy and adapt)")
    p = sub.add_parser("init", help="write a starter search space for a model on the hardware at hand")
    p.add_argument("model", help="a preset (paratune models), a model folder (config.json + safetensors) or a config.json")
    p.add_argument("--gpus", type=int, help="GPUs (default: one node of --device, the Ray cluster's, or this machine's)")
    p.add_argument("--device", help="device from the table (h100-80gb, a100-80gb, ..., cpu); default: the running "
                                    "Ray cluster's (RAY_ADDRESS) or this machine's")
    p.add_argument("--devices", help="a JSON/YAML file adding or overriding devices")
    p.add_argument("--lora", action="store_true", help="fine-tune LoRA adapters (the base frozen) instead of every weight")
    p.add_argument("--data", help="your data file (.jsonl, .parquet, or text); default: synthetic tokens")
    p.add_argument("--text-field", help="the records' text field (default: the first string field)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's window, capped)")
    p.add_argument("--out", help="the space file to write (default: <name>.yaml here)")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    from paratune.commands.catalog import cmd_models, cmd_spaces
    from paratune.commands.cluster import cmd_profile, cmd_ui

    handler = {"trial": _cmd_trial, "tune": _cmd_tune, "report": _cmd_report, "train": _cmd_train, "plan": _cmd_plan, "ui": cmd_ui,
               "validate": _cmd_validate, "models": cmd_models, "spaces": cmd_spaces, "init": _cmd_init,
               "profile": cmd_profile}[args.command]
    return handler(args, console)


if __name__ == "__main__":
    sys.exit(main())

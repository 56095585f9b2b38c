"""`paratune profile` and `paratune ui`: the commands that look at the cluster and the tracking server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape


def cmd_profile(args: argparse.Namespace, console: Console) -> int:
    """Profile what a space's plans need on the running Ray cluster (or an in-process one), store
    it under PARATUNE_HOME/profiles (reused when it already covers the plans), write --out."""
    from paratune.costs.profile import ProfileError, ProfileStore, profile_requests_for
    from paratune.cluster.profiling import run_profile
    from paratune.sweep.space import SpaceError, load_space
    from paratune.cluster.launch import ensure_ray

    try:
        space = load_space(args.space)
    except SpaceError as err:
        console.print(f"[red]invalid space[/red]\n{escape(str(err))}")
        return 2
    plans = [space.plan_for(c.choices, env) if env else c.plan for c in space.candidates for env in space.env_grid()]
    requests = profile_requests_for(plans, reps=args.reps)
    store = ProfileStore(args.store) if args.store else ProfileStore()
    ensure_ray()
    device_name = _cluster_device_name()
    profiles = []
    for i, request in enumerate(requests, 1):
        cached = None if args.force else store.get(request, device_name)
        label = f"{request.model}, {request.world_size} workers, env {request.env or '{}'}"
        if cached is not None:
            console.print(f"profile {i}/{len(requests)} ({label}): reused {store.path(store.key_for_profile(cached))}")
            profiles.append(cached)
            continue
        with console.status(f"profile {i}/{len(requests)}: {label} ({len(request.blocks)} block shapes, "
                            f"{len(request.groups)} group layouts)"):
            try:
                profile = run_profile(request)
            except ProfileError as err:
                console.print(f"[red]{escape(str(err))}[/red]")
                return 1
        path = store.put(profile)
        console.print(f"profile {i}/{len(requests)} ({label}): measured in {profile.profile_s:.1f} s on "
                      f"{profile.device_name}, stored {path}")
        profiles.append(profile)
    from paratune.out.tables import print_profiles

    print_profiles(profiles, console)
    if args.out:
        Path(args.out).write_text(json.dumps([p.model_dump(mode="json") for p in profiles], indent=1))
        console.print(f"profiles written to {args.out}; predict with: paratune plan {args.space} --profile {args.out}")
    return 0


def _cluster_device_name() -> str:
    """The name a profile of this cluster is stored under: a GPU's as torch reports it, else cpu."""
    import ray

    if ray.cluster_resources().get("GPU", 0) >= 1:
        from paratune.config.devices import probe_gpu

        answer = probe_gpu()
        if answer is not None:
            return answer[0]
    return "cpu"


def cmd_ui(args: argparse.Namespace, console: Console) -> int:
    import os

    from paratune.out.tracking import default_tracking_uri

    uri = args.tracking_uri or default_tracking_uri()
    base = f"http://{args.host}:{args.port}"
    console.print(f"MLflow UI on {base} for {uri} (Ctrl-C to stop)")
    link = _sweep_runs_link(uri, base)
    if link:
        console.print(f"the sweeps' runs (parent runs, trials under each; select trials, then Compare):\n  {link}")
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")  # ~0.5 GB instead of ~3 GB
    mlflow = Path(sys.executable).parent / "mlflow"
    # One worker process: a local UI for one person needs no pool, and each of MLflow's default
    # four imports the whole server (memory, and seconds of CPU on a small machine).
    os.execv(str(mlflow), [str(mlflow), "ui", "--backend-store-uri", uri, "--host", args.host,
                           "--port", str(args.port), "--workers", "1"])
    return 0


def _sweep_runs_link(uri: str, base: str) -> str | None:
    """The paratune experiment's runs table (MLflow's "Machine learning" view), if the store has it."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    try:
        from mlflow.tracking import MlflowClient

        from paratune.out.tracking import DEFAULT_EXPERIMENT, runs_url

        experiment = MlflowClient(tracking_uri=uri).get_experiment_by_name(DEFAULT_EXPERIMENT)
    except Exception:  # noqa: BLE001 - only a convenience: the UI starts anyway
        return None
    return runs_url(base, experiment.experiment_id) if experiment is not None else None

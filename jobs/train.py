"""Entry point for `ray job submit`: train with a plan (e.g. an exported winner) for N steps.

    ray job submit --address http://127.0.0.1:8265 --working-dir . --runtime-env jobs/runtime_env.yaml \
        -- python jobs/train.py --plan paratune_runs/<sweep>/winner/plan.yaml --steps 1000

Runs the plan on the cluster the job was submitted to (RAY_ADDRESS) as one measured Ray Train
run, and prints its throughput and loss curve. (Checkpointing and resume after a worker fault
come with the cluster issue.)
"""

from __future__ import annotations

import argparse
import json
import sys

from paratune.plan import PlanError, load_plan
from paratune.trial import run_trial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="plan YAML (e.g. winner/plan.yaml)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps to train")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    try:
        plan = load_plan(args.plan).with_changes(measure_steps=args.steps, profile_comm=False, track_memory=False,
                                                 trial_timeout_s=max(3600.0, args.steps * 60.0))
    except PlanError as err:
        print(f"invalid plan\n{err}", file=sys.stderr)
        return 2
    result = run_trial(plan)
    print(json.dumps({k: v for k, v in result.model_dump().items() if k not in ("plan", "step_times_s")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.model_dump_json(indent=1))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())

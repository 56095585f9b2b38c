"""A `ray job submit` entry point for tests/test_cluster_jobs.py: one plan run twice on the
multi-node test cluster, first packed by Ray onto nodes with 3 + 1 free CPUs (1 of node2's 2
CPUs held by a placement group, as on a busy cluster), then on whole nodes (gpus_per_node 2).

    python tests/placement_job.py PLAN_JSON OUT_JSON
"""

import json
import sys

import ray

from paratune.trial import run_trial

if __name__ == "__main__":
    plan, out = json.loads(sys.argv[1]), sys.argv[2]
    ray.init()
    held = ray.util.placement_group([{"CPU": 1, "paratune_node2": 0.01}])
    ray.get(held.ready())
    packed = run_trial(plan)
    ray.util.remove_placement_group(held)
    whole = run_trial({**plan, "gpus_per_node": 2})
    with open(out, "w") as f:
        json.dump([packed.model_dump(), whole.model_dump()], f)

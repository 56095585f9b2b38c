"""A `ray job submit` entry point for tests/test_cluster_jobs.py: a tp-2 plan on the multi-node
test cluster (worker nodes of 3 and 2 CPUs), first as Ray packs it when no rank pair fits one
node (2 workers of 2 CPUs: one on each node), then with 4 workers on whole nodes (gpus_per_node 2).

    python tests/placement_job.py PLAN_JSON OUT_JSON
"""

import json
import sys

import ray

from paratune.cluster.trial import run_trial

if __name__ == "__main__":
    plan, out = json.loads(sys.argv[1]), sys.argv[2]
    ray.init()
    packed = run_trial({**plan, "num_workers": 2, "cpus_per_worker": 2})
    whole = run_trial({**plan, "gpus_per_node": 2})
    with open(out, "w") as f:
        json.dump([packed.model_dump(), whole.model_dump()], f)

"""Entry point for `ray job submit`: run an autotune sweep on the cluster the job runs on.

    ray job submit --address http://127.0.0.1:8265 --working-dir . --runtime-env jobs/runtime_env.yaml \
        -- python jobs/sweep.py search_spaces/llama3_8b_1x8.yaml --trials 24

Takes the same arguments as `paratune tune`.
"""

import sys

from paratune.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))

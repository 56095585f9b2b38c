"""Entry point for `ray job submit`: train with a plan (e.g. an exported winner), checkpointed.

    ray job submit --address http://127.0.0.1:8265 --working-dir . --runtime-env jobs/runtime_env.yaml \
        -- python jobs/train.py /home/ray/paratune_runs/<sweep>/winner/plan.yaml --steps 1000 \
           --checkpoint-every 100 --name llama3-8b-winner

Takes the same arguments as `paratune train`: checkpoints every N steps to Ray Train's storage
(PARATUNE_STORAGE), resumes from the last checkpoint when a worker dies (--max-failures), and
continues a run given the same --name again (e.g. after the job itself was stopped).
"""

import sys

from paratune.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

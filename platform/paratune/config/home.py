"""Where paratune writes on this machine: sweeps, training runs, traced activations, profiles.

Torch- and Ray-free, so the cost model and the commands can ask without importing the launch path.
"""

from __future__ import annotations

import os
from pathlib import Path


def paratune_home() -> Path:
    """Where sweeps and training runs write (PARATUNE_HOME, else ./paratune_runs). Under `ray job
    submit` the working directory is a temporary copy, so jobs/runtime_env.yaml sets it."""
    return Path(os.environ.get("PARATUNE_HOME") or Path.cwd() / "paratune_runs").expanduser().resolve()


def default_storage() -> str:
    """Ray Train's storage_path: PARATUNE_STORAGE (shared storage: NFS path or s3://... on a
    multi-node cluster, where checkpoints must outlive a node), else under paratune_home()."""
    return os.environ.get("PARATUNE_STORAGE") or str(paratune_home() / "ray")

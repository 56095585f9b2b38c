"""paratune: find the fastest parallel training configuration that still trains correctly."""

__version__ = "0.1.0"

import os as _os

# Ray 2.49-2.50 run Train V2 only with this documented switch set before ray.train is imported (2.51+
# default it on); paratune's API (ray.train.UserCallback, FailureConfig(controller_failure_limit),
# Tune function trainables launching a TorchTrainer) is V2's. Ray Tune hands it on to its trainables.
_os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

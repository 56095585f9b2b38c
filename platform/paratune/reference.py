"""Moved: the single-process reference lives in paratune.parity (this name is kept for old imports)."""

# moved: see paratune.parity; kept until the layout pass
from paratune.parity import max_loss_difference, reference_losses  # noqa: F401

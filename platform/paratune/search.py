"""Moved: the sweep's stopping rule is paratune.sweep.stopping (SweepStopRule); this name is kept for old imports."""

# moved: see paratune.sweep.stopping; kept until the layout pass
from paratune.sweep.stopping import Decision, Incumbent, StoppingRule, SweepStopRule  # noqa: F401

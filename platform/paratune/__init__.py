"""paratune: find the fastest parallel training configuration that still trains correctly."""

__version__ = "0.1.0"

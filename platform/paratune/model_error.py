"""The error a model that cannot be built raises: its own module, torch-free, so the config readers
(paratune.models) and the builder (paratune.materialize) both raise it without importing each other."""


class ModelError(ValueError):
    """A model spec that cannot be built (unknown preset, bad path, not a causal decoder, a slot
    nothing initializes)."""

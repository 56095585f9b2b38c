"""Third-party log lines paratune knows to be harmless, filtered at their loggers before anything emits them.

Each filter names its cause; nothing else from those loggers is touched. torch-free (the command
line installs them first thing, before transformers imports torchao).
"""

from __future__ import annotations

import logging


class TorchaoImportNoise(logging.Filter):
    """torchao's wheel ships C++ extensions built for other Pythons / torch builds: importing it
    warns "Failed to load .../_C_*.so" once per library, and torch warns once per Enum torchao
    registers as a pytree constant (deprecated in torch 2.13). torchao's float8 training is pure
    Python (the kernels are torch's `_scaled_mm`), so those lines are noise. transformers imports
    torchao whenever it is installed (transformers/quantizers/quantizer_torchao.py), building any
    model, so the filter goes on before any model is built, not only for float8 plans."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ((message.startswith("Failed to load") and "/_C" in message)
                    or "is an Enum subclass and is now natively supported" in message)


def quiet_torchao_import() -> None:
    """Filter torchao's import noise from this process's log (idempotent)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, TorchaoImportNoise) for f in logger.filters):
            logger.addFilter(TorchaoImportNoise())


class RayTokenAuthNotice(logging.Filter):
    """Ray 2.60 turns token authentication on for a new local cluster when RAY_AUTH_MODE is unset,
    and says so at every start ("Token authentication is enabled for this Ray cluster. Set
    RAY_AUTH_MODE=disabled to opt out", ray/_private/authentication/authentication_token_setup.py).
    paratune keeps it on by design (docs/DESIGN.md: Ray facts): the notice tells a user nothing to do.
    The opposite warning (auth disabled) is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def quiet_ray_start() -> None:
    """Filter Ray's token-auth notice (idempotent; before `ray.init`)."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, RayTokenAuthNotice) for f in logger.filters):
        logger.addFilter(RayTokenAuthNotice())


class DeepSpeedCpuNotice(logging.Filter):
    """DeepSpeed picks its CPU accelerator on a machine without a GPU and warns "Setting accelerator
    to CPU. If you have GPU or other accelerator, we were unable to detect it."
    (deepspeed/accelerator/real_accelerator.py) as paratune imports it for a ZeRO plan's config.
    Dropped only where torch sees no GPU either (then CPU is right); on a GPU machine it stays: there
    it would mean DeepSpeed missed the GPU."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Setting accelerator to CPU"):
            return True
        import sys

        torch = sys.modules.get("torch")
        return bool(torch is not None and torch.cuda.is_available())


class MlflowStoreSetup(logging.Filter):
    """MLflow says at INFO that it makes a new SQLite store's tables ("Creating initial MLflow
    database tables...", "Updating database tables", mlflow/store/db/utils.py): what a first sweep
    in a folder always does. Its other lines stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Creating initial MLflow database tables") or message == "Updating database tables")


def _add(name: str, kind: type[logging.Filter]) -> None:
    logger = logging.getLogger(name)
    if not any(isinstance(f, kind) for f in logger.filters):
        logger.addFilter(kind())


def quiet() -> None:
    """Every filter above, on its logger (idempotent): what the command line installs first thing."""
    quiet_torchao_import()
    quiet_ray_start()
    _add("DeepSpeed", DeepSpeedCpuNotice)
    _add("mlflow.store.db.utils", MlflowStoreSetup)

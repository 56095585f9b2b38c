"""TEST-ONLY: a Python shaped like the lent GPU machine's image (see bench/gpu_image.txt).

That image has torch, transformers, accelerate, peft and safetensors, and no Ray, MLflow or
Optuna. Put this folder first on PYTHONPATH and those three cannot be imported, whatever this
venv has: `import ray` raises ModuleNotFoundError as it would there. (tests/test_gpu_acceptance.py
runs bench/gpu_acceptance.py's smoke mode so, with the image's transformers from the overlay
`make install` builds.)
"""

import importlib.util
import sys

ABSENT_ON_THE_GPU_IMAGE = frozenset({"ray", "mlflow", "optuna"})


class _NotOnTheImage:
    """A meta-path finder that refuses the packages the image lacks (and everything under them)."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT_ON_THE_GPU_IMAGE:
            raise ModuleNotFoundError(f"No module named '{name}' (not on the GPU image)", name=name)
        return None


sys.meta_path.insert(0, _NotOnTheImage())

_find_spec = importlib.util.find_spec


def _find_spec_as_on_the_image(name, package=None):
    """`importlib.util.find_spec` answers None for an absent package, as it would there: libraries
    probe optional packages so (accelerate's `_is_package_available("mlflow")`, which transformers
    reaches on import) and must read "not installed", not an ImportError."""
    if name.partition(".")[0] in ABSENT_ON_THE_GPU_IMAGE:
        return None
    return _find_spec(name, package)


importlib.util.find_spec = _find_spec_as_on_the_image

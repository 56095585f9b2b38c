"""The public API (paratune/__init__.py) and what stays out of light paths.

`paratune report` and `import paratune` run in fresh processes, so what this test process imported
before does not count.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "platform"), os.environ.get("PYTHONPATH"))
                                                        if p)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_the_page_and_paratune_report_never_load_ray_tune():
    """The page, what `paratune report` calls (finish.write_page) and the ledger."""
    assert _fresh("import sys\n"
                  "import paratune.sweep.page, paratune.sweep.finish\n"
                  "from paratune.sweep.ledger import Ledger\n"
                  "print('ray.tune' in sys.modules)\n") == "False"


def test_import_paratune_loads_neither_torch_nor_ray():
    assert _fresh("import sys, paratune\nprint('torch' in sys.modules or 'ray' in sys.modules, paratune.__version__)\n") \
        .startswith("False ")


def test_every_public_name_resolves_to_its_module_and_the_readme_shows_it():
    import paratune
    from paratune.config.plan import load_plan
    from paratune.sweep.driver import run_sweep
    from paratune.cluster.trial import run_trial

    assert paratune.load_plan is load_plan and paratune.run_sweep is run_sweep and paratune.run_trial is run_trial
    readme = (ROOT / "README.md").read_text()
    for name in paratune.__all__:
        assert getattr(paratune, name) is not None, name
        if name != "__version__":
            assert re.search(rf"\b{name}\b", readme), f"README does not show paratune.{name}"
    assert sorted(dir(paratune)) == dir(paratune) and set(paratune.__all__) <= set(dir(paratune))


def test_the_old_single_module_names_are_gone():
    """`paratune.sweep` is a package of modules; its old re-exports went with issue 42."""
    import paratune.sweep as sweep

    assert not hasattr(sweep, "run_sweep") and not hasattr(sweep, "_MOVED")

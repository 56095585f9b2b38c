"""The sweep package's layout: what `paratune report` loads, and the old names kept for users.

`paratune.sweep` was one module that imported Ray Tune at the top; it is a package whose
`__init__` re-exports the old names lazily (PEP 562), so the report's path never loads Tune.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_page_and_paratune_report_never_load_ray_tune():
    """In a fresh process, so what this test process imported before does not count: the page,
    what `paratune report` calls (finish.write_page) and the ledger by its old name."""
    code = ("import sys\n"
            "import paratune.sweep.page, paratune.sweep.finish\n"
            "from paratune.sweep import Ledger, write_report\n"
            "print('ray.tune' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "platform"), os.environ.get("PYTHONPATH"))
                                                        if p)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False", proc.stdout


def test_the_old_names_are_the_new_objects():
    import paratune.sweep as sweep
    from paratune import parity
    from paratune.sweep.finish import SweepOutcome, finish_sweep, write_page
    from paratune.sweep.stopping import SweepStopRule

    assert sweep.SweepReport is SweepOutcome and sweep.write_report is write_page
    assert sweep.StoppingRule is SweepStopRule and sweep.finish_sweep is finish_sweep
    assert sweep.winner_parity is parity.winner_parity and sweep.Parity is parity.Parity
    for name in sweep._MOVED:  # every old name resolves
        assert getattr(sweep, name) is not None, name
    assert "run_sweep" in dir(sweep)

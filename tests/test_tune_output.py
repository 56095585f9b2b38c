"""Tune's console reporter, quieted (paratune.sweep.callbacks.QuietTuneOutput). Tune calls it for every
trial event; a call that raises there becomes a TuneError that ends the whole sweep. Seen in a full
run (2026-12-06): a resumed sweep's trial died with its node, Tune called on_trial_error, and the base
class formatted its unset `_addressing_tmpl` (None): the sweep job failed instead of going on."""

import types

import pytest

from paratune.sweep.callbacks import QuietTuneOutput

pytestmark = pytest.mark.skipif(not QuietTuneOutput.available, reason="this Ray has no AIR console reporter")


def test_a_trial_that_errored_at_tunes_level_passes_quietly(capsys):
    reporter = QuietTuneOutput()
    # what the reporter reads of Ray's Trial (a real one needs a running Tune session and its storage)
    trial = types.SimpleNamespace(last_result={"training_iteration": 0}, error_file="/tmp/error.txt", config={},
                                  trial_id="t1", status="ERROR")
    reporter.on_trial_error(iteration=3, trials=[trial], trial=trial)  # raised AttributeError before
    reporter.on_trial_complete(iteration=3, trials=[trial], trial=trial)
    assert capsys.readouterr().out == ""  # paratune says the failure itself (LedgerCallback)
    assert reporter._addressing_tmpl.format("t1") == "Trial t1"  # any other per-trial line formats too

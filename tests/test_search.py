"""The calibrated search's stopping rule (paratune.sweep.stopping): pure, so tested without Ray."""

import pytest

from paratune.sweep.stopping import Incumbent, SweepStopRule

PREDICTED = {"a": 1000.0, "b": 900.0, "c": 700.0, "d": 400.0}


def test_measures_the_fastest_predicted_plan_that_is_neither_measured_nor_running():
    rule = SweepStopRule(min_trials=1)
    assert rule.decide(PREDICTED, set(), set(), None, 0.1, 0).next_key == "a"
    assert rule.decide(PREDICTED, {"a"}, {"b"}, None, 0.1, 1).next_key == "c"
    everything = rule.decide(PREDICTED, set(PREDICTED), set(), Incumbent("a", 1000.0), 0.1, 4)
    assert everything.stop and everything.next_key is None and "every plan" in everything.reason


def test_stops_only_when_no_unmeasured_plan_can_beat_the_incumbent_by_noise_plus_model_error():
    rule = SweepStopRule(min_trials=2)
    incumbent = Incumbent("a", 1000.0, spread=0.02)  # its noise band is the 5% floor
    # b: 900 x 1.10 = 990 <= 1000 x 1.05: cannot win.
    stop = rule.decide(PREDICTED, {"a"}, set(), incumbent, band=0.10, measured_trials=2)
    assert stop.stop and "990" in stop.reason and "1,050" in stop.reason
    # A wider model error band (the model has been wrong by 20%): b might still win.
    go_on = rule.decide(PREDICTED, {"a"}, set(), incumbent, band=0.20, measured_trials=2)
    assert not go_on.stop and go_on.next_key == "b"
    # A noisier incumbent raises the bar (its band is half its spread): 900 x 1.2 = 1080 <= 1150.
    assert rule.decide(PREDICTED, {"a"}, set(), Incumbent("a", 1000.0, 0.30), 0.20, 2).stop


def test_never_stops_before_the_model_has_seen_its_minimum_trials_or_without_an_incumbent():
    rule = SweepStopRule(min_trials=3)
    assert not rule.decide(PREDICTED, {"a"}, set(), Incumbent("a", 5000.0), 0.0, measured_trials=2).stop
    assert not rule.decide(PREDICTED, {"a", "b", "c"}, set(), None, 0.0, measured_trials=3).stop


@pytest.mark.parametrize("band,expected", [(0.0, False), (0.5, True)])
def test_can_win_is_the_stated_inequality(band, expected):
    assert SweepStopRule().can_win(800.0, Incumbent("x", 1000.0, 0.0), band) is expected  # 800(1+b) > 1050

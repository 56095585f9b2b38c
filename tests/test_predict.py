"""One TimePredictor interface for the roofline and the calibrated (profile-composed) model."""

import pytest
from test_timemodel import make_profile, plan

from paratune.config.devices import get_device
from paratune.costs.estimate import Roofline
from paratune.costs.predict import RooflinePredictor, StepPrediction, TimePredictor
from paratune.costs.timemodel import StepTimeModel


def test_the_roofline_and_the_calibrated_model_answer_alike():
    roofline, calibrated = RooflinePredictor(Roofline(get_device("cpu"), 4)), StepTimeModel([make_profile()])
    p = plan(micro_batch=2)
    for model in (roofline, calibrated):
        assert isinstance(model, TimePredictor)
        pred = model.predict(p)
        assert isinstance(pred, StepPrediction) and pred.step_s > 0
        assert sum(pred.parts.values()) == pytest.approx(pred.step_s)
        assert pred.tokens_per_s_per_gpu == pytest.approx(p.tokens_per_step / pred.step_s / p.num_workers)
        out = model.observe(p, 2 * pred.step_s)
        assert out["predicted_step_time_s"] == pytest.approx(pred.step_s)
        assert out["step_time_prediction_error"] == pytest.approx(-0.5)
        assert model.error_band() > 0 and isinstance(model.summary(), dict)
    # The roofline's prediction is its estimate's time, as sweep.RooflineTimeModel's was.
    fresh = Roofline(get_device("cpu"), 4)
    assert RooflinePredictor(fresh).predict(p).step_s == fresh.predict(p).time.step_s
    assert RooflinePredictor(fresh).error_band() == RooflinePredictor.PRIOR_BAND

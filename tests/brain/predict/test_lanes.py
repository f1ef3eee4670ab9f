"""One predictor state per batch lane (`seqmoe.brain.predict.lanes`): lanes are independent, and the
forecast of a step is the probability that any of its rows uses an expert.
Run: pytest tests/brain/predict/test_lanes.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from seqmoe.brain.predict.base import Forecast
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.brain.predict.lanes import LanePredictors, union_forecast
from seqmoe.brain.predict.online import OnlineForecaster, NoLearner, online_config


def test_union_is_one_minus_the_product_of_misses_over_the_positions_any_covers():
    a = Forecast(np.array([4, 5]), np.array([[0.5, 0.0], [0.2, 1.0]], np.float32))
    b = Forecast(np.array([3, 5, 6]), np.array([[0.9, 0.9], [0.5, 0.5], [0.1, 0.0]], np.float32))
    u = union_forecast([a, b], step=3)
    np.testing.assert_array_equal(u.steps, [4, 5, 6])  # position 3 is not after the step
    np.testing.assert_allclose(u.probs, [[0.5, 0.0], [0.6, 1.0], [0.1, 0.0]], rtol=1e-6)


def _feed(pred, trace, t, step, lane=None):
    """Feed token t of `trace` as position `step`'s token to `pred` (a lane of it when `lane` is given)."""
    L = trace.num_layers
    for l in range(L):
        if l == 0:
            pred.begin_token(step, None)
        pred.observe(step + l, trace.expert_ids[t, l])


def test_a_lane_forecasts_as_its_sequence_alone_whatever_the_other_lanes_see(tiny_forecaster):
    d, train, test = tiny_forecaster
    alone = load_seq_predictor(d / "pred").with_window(None)
    lanes = LanePredictors(load_seq_predictor(d / "pred").with_window(None))
    L = test.num_layers
    lanes.set_rows([0, 1])
    lanes.begin_request(0)
    lanes.begin_request(1)
    alone.begin_request()
    for s in range(6):
        step = s * L
        lanes.begin_token(step, [None, None])
        alone.begin_token(step, None)
        for l in range(L):
            lanes.observe(step + l, np.stack([test.expert_ids[40 + s, l], test.expert_ids[s, l]]))
            alone.observe(step + l, test.expert_ids[s, l])
        lanes.predict(step + L - 1)
    mine = lanes.lane(1).predict(6 * L - 1)
    ref = alone.predict(6 * L - 1)
    np.testing.assert_array_equal(mine.steps, ref.steps)
    np.testing.assert_allclose(mine.probs, ref.probs, rtol=1e-5, atol=1e-6)
    other = lanes.lane(0).predict(6 * L - 1)
    assert not np.allclose(other.probs, ref.probs)  # lane 0 saw another sequence


def test_online_lanes_follow_the_forecasters_swaps():
    fc = OnlineForecaster(online_config(2, 8, 2), NoLearner())
    lanes = LanePredictors(fc)
    lanes.set_rows([0, 1])
    lanes.begin_token(0, [None, None])
    assert lanes.predict(0) is None  # nothing learned yet, in any lane
    fc._swap({k: np.zeros(v, np.float32) for k, v in fc.config.weight_shapes().items()})
    lanes.begin_token(2, [None, None])
    assert lanes.lane(1).inner.w["route_in"] is fc.inner.w["route_in"]  # the same weights, not a copy
    assert lanes.predict(2) is not None


@pytest.mark.parametrize("first", [0, 1])
def test_far_is_the_largest_over_the_rows(first):
    class Head:
        def __init__(self, far):
            self.far = far

        def begin_request(self):
            pass

        def begin_token(self, step, token):
            pass

        def set_row(self, row):
            pass

        def fork(self):
            return Head(np.array([0.1, 0.9]) if first else np.array([0.5, 0.2]))

    lanes = LanePredictors(Head(np.array([0.3, 0.3])))
    lanes.set_rows([0, 1])
    lanes.begin_token(0, [None, None])
    np.testing.assert_array_equal(lanes.far, np.maximum([0.3, 0.3], lanes.lane(1).far))


def test_moe_infinity_style_eviction_reads_the_batchs_request_matrices():
    from seqmoe.brain.predict.baselines.eam import EAMPolicy, EAMPredictor
    from tests.conftest import make_trace

    pred = EAMPredictor(make_trace(num_tokens=60, num_layers=2, num_experts=4, top_k=1))
    lanes = LanePredictors(pred)
    lanes.set_rows([0, 1])
    lanes.observe(0, np.array([[0], [3]]))  # layer 0: lane 0 used expert 0, lane 1 expert 3
    np.testing.assert_array_equal(pred.batch_counts()[:4], [1, 0, 0, 1])
    policy = EAMPolicy(pred)
    policy.reset([0, 1, 3])
    assert policy.victim(2, pinned=()) == 1  # neither request used expert 1; lane 1's expert 3 is kept

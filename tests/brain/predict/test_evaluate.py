"""Forecast metrics on hand-made cases: oracle, constant and uncovered forecasts.

Run: .venv/bin/python -m pytest tests/brain/predict/test_evaluate.py -q
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.brain.predict.evaluate import (
    default_horizons, evaluate_predictor, evaluate_predictors, format_table, plot_recall, predicted_sets, topk_hits,
)  # fmt: skip
from seqmoe.brain.predict.baselines.external import ExternalPredictor
from seqmoe.brain.predict.baselines.freq import FrequencyPredictor, layer_popularity
from tests.conftest import make_trace


class Oracle(Predictor):
    """Knows the trace: forecasts the true experts with probability 1 for `horizon` positions."""

    def __init__(self, trace, horizon: int) -> None:
        T, L, K = trace.expert_ids.shape
        self.onehot = np.zeros((T * L + horizon + 1, trace.num_experts), dtype=np.float32)
        flat = trace.expert_ids.reshape(T * L, K)
        np.put_along_axis(self.onehot[: T * L], flat.astype(np.int64), 1.0, axis=1)
        self.horizon = horizon

    def begin_request(self):
        pass

    def begin_token(self, step, token_id):
        pass

    def observe(self, step, ids):
        pass

    def predict(self, step):
        steps = np.arange(step + 1, step + 1 + self.horizon)
        return Forecast(steps, self.onehot[steps])


class Constant(Oracle):
    """Always forecasts experts 0..K-1, for only `horizon` positions."""

    def predict(self, step):
        steps = np.arange(step + 1, step + 1 + self.horizon)
        probs = np.zeros((self.horizon, self.onehot.shape[1]), dtype=np.float32)
        probs[:, :2] = 1.0
        return Forecast(steps, probs)


def test_topk_hits_by_hand():
    probs = np.array([[0.9, 0.8, 0.1, 0.0], [0.0, 0.1, 0.7, 0.6]])
    truth = np.array([[0, 2], [2, 3]])
    assert topk_hits(probs, truth, 2).tolist() == [1, 2]
    assert topk_hits(probs, truth, 3).tolist() == [2, 2]
    assert topk_hits(probs, truth, 4).tolist() == [2, 2]


def test_oracle_scores_one():
    trace = make_trace(num_tokens=60, num_layers=3, num_experts=8, top_k=2)
    hs = default_horizons(3)
    assert hs == (1, 2, 3, 4, 6)
    res = evaluate_predictor(trace, Oracle(trace, 6), horizons=hs)
    for h in hs:
        assert res["recall_at_k"][h] == 1.0 and res["recall_at_2k"][h] == 1.0
        assert res["uncovered"][h] == 0
    # Only targets inside the request count: fewer targets for longer horizons.
    assert res["targets"][1] > res["targets"][6] > 0


def test_constant_and_uncovered():
    trace = make_trace(num_tokens=60, num_layers=3, num_experts=8, top_k=2)
    res = evaluate_predictor(trace, Constant(trace, 2), horizons=(1, 2, 4))
    T, L, K = trace.expert_ids.shape
    # Forecast {0, 1} at every covered horizon: recall = mean share of {0, 1} in the true pair.
    share = np.isin(trace.expert_ids, [0, 1]).sum(axis=2).reshape(-1) / K
    assert abs(res["recall_at_k"][1] - share[1:].mean()) < 0.05
    assert res["recall_at_k"][4] == 0.0 and res["uncovered"][4] == res["targets"][4] > 0


def test_stride_and_frequency(tmp_path):
    train = make_trace(num_tokens=200, seed=1)
    test = make_trace(num_tokens=60, seed=2)
    pop = layer_popularity(train)
    assert np.allclose(pop.sum(axis=1), train.top_k)
    full = evaluate_predictor(test, FrequencyPredictor(train))
    half = evaluate_predictor(test, FrequencyPredictor(train), stride=2)
    assert half["targets"][1] < full["targets"][1]
    res = evaluate_predictors(test, {"freq": FrequencyPredictor(train), "oracle": Oracle(test, 6)})
    table = format_table(res)
    assert "oracle" in table and "h=L" in table and "1.000" in table
    assert res["predictors"]["freq"]["decision"]["us_per_layer"] > 0
    plot_recall(res, tmp_path / "recall.png", caption="test")
    assert (tmp_path / "recall.png").stat().st_size > 1000


def _sklearn_style(pred_sets: np.ndarray, true_sets: np.ndarray, E: int) -> tuple[float, float]:
    """(element accuracy, macro-F1) of [N, k] predicted against [N, K] true sets as E-way multi-hot rows."""
    n = len(true_sets)
    pred, true = np.zeros((n, E), bool), np.zeros((n, E), bool)
    pred[np.arange(n)[:, None], pred_sets] = True
    true[np.arange(n)[:, None], true_sets] = True
    f1 = []
    for e in range(E):
        tp, fp, fn = (pred[:, e] & true[:, e]).sum(), (pred[:, e] & ~true[:, e]).sum(), (~pred[:, e] & true[:, e]).sum()
        f1.append(2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn else 0.0)
    return (pred == true).mean(), float(np.mean(f1))


def test_accuracy_and_macro_f1_of_replayed_predictions_match_their_definition():
    trace = make_trace(num_tokens=80, num_layers=3, num_experts=8, top_k=2, num_requests=1)
    rng = np.random.default_rng(1)
    noisy = np.where(rng.random(trace.expert_ids.shape) < 0.5, trace.expert_ids, rng.integers(0, 8, trace.expert_ids.shape))
    noisy[..., 1] = np.where(noisy[..., 1] == noisy[..., 0], (noisy[..., 0] + 1) % 8, noisy[..., 1])
    res = evaluate_predictor(trace, ExternalPredictor(noisy, trace.request_offsets, num_experts=8, lead=0), horizons=(1,))
    flat_pred, flat_true = noisy.reshape(-1, 2)[1:], trace.expert_ids.reshape(-1, 2)[1:]  # position 0 is no target
    accuracy, f1 = _sklearn_style(flat_pred, flat_true, 8)
    assert abs(res["accuracy"][1] - accuracy) < 1e-12 and abs(res["macro_f1"][1] - f1) < 1e-12
    assert 0 < f1 < 1
    # recall at a cache of C experts per layer and stalls per token = L x K x (1 - recall@C)
    assert abs(res["stalls_per_token"][1] - 3 * 2 * (1 - res["recall_at_c"][1])) < 1e-12


def test_predicted_sets_are_the_forecast_made_that_far_back():
    trace = make_trace(num_tokens=40, num_layers=3, num_experts=8, top_k=2, num_requests=2)
    sets = predicted_sets(trace, Oracle(trace, 6), distance=2, fallback=np.full((3, 2), 7))
    T, L, K = trace.expert_ids.shape
    positions = np.arange(T * L).reshape(T, L)
    starts = trace.request_offsets[:-1] * L
    early = np.isin(positions, np.concatenate([starts, starts + 1]))  # nothing observed 2 positions before
    same = np.sort(sets, -1) == np.sort(trace.expert_ids, -1)
    assert same.all(-1)[~early].all() and (sets[early] == 7).all()

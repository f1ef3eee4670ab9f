"""Pre-gate forecasts and their fusion with a history forecast.

Run: pytest tests/brain/predict/test_pregate.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from seqmoe.base.errors import UserError
from seqmoe.brain.predict.base import Forecast, IgnoresHistory
from seqmoe.brain.predict.pregate import HybridPredictor, PregatePredictor, fit_alphas, fuse
from seqmoe.trace.schema import RoutingTrace, TraceMeta

T, L, E, K = 60, 4, 8, 2


def _trace(pregate_quality: float, seed: int = 0) -> RoutingTrace:
    """Random routing whose pre-gate logits point at the true experts by `pregate_quality` nats."""
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(T)]).astype(np.int16)
    pre = np.full((T, L, L - 1, E), np.nan, dtype=np.float16)
    for t in range(T):
        for l in range(L):
            for h in range(1, L - l):
                z = rng.normal(size=E)
                z[ids[t, l + h]] += pregate_quality
                pre[t, l, h - 1] = z
    return RoutingTrace(expert_ids=ids, request_offsets=np.array([0, T // 2, T]), meta=TraceMeta(num_experts=E),
                        pregate_logits=pre)


class _Uniform(IgnoresHistory):
    """A history forecaster that knows nothing: every expert K / E, 2L positions ahead."""

    def forecast(self, step, horizon):
        return Forecast(np.arange(step + 1, step + 1 + horizon), np.full((horizon, E), K / E, dtype=np.float32))

    def predict(self, step):
        return self.forecast(step, 2 * L)


def test_pregate_rows_are_the_later_routers_softmax_within_the_token():
    trace = _trace(3.0)
    pred = PregatePredictor(trace)
    pred.begin_request()
    pred.observe(5, trace.expert_ids[1, 1])  # token 1, layer 1: layers 2 and 3 remain
    fc = pred.predict(5)
    assert fc.steps.tolist() == [6, 7]
    z = trace.pregate_logits[1, 1, :2].astype(np.float64)
    want = np.exp(z - z.max(axis=1, keepdims=True))
    assert np.allclose(fc.probs, want / want.sum(axis=1, keepdims=True) * K, atol=1e-5)
    pred.observe(7, trace.expert_ids[1, 3])
    assert len(pred.predict(7).steps) == 0  # the last layer: nothing later in the token


def test_fusion_weights_go_to_the_better_source():
    assert fit_alphas(_Uniform(), _trace(6.0)).tolist() == [0.0] * (L - 1)  # pre-gate knows, history does not


def test_fuse_keeps_the_mass_and_its_endpoints_rank_as_each_source():
    h = np.array([0.5, 0.3, 0.1, 0.1])
    g = np.array([0.1, 0.2, 0.6, 0.1])
    assert np.isclose(fuse(h, g, 0.4).sum(), h.sum())
    assert np.argmax(fuse(h, g, 1.0)) == 0 and np.argmax(fuse(h, g, 0.0)) == 2


def test_hybrid_with_history_weight_one_is_the_history_forecast():
    trace = _trace(3.0)
    hyb = HybridPredictor(_Uniform(), trace, np.ones(L - 1))
    hyb.begin_request()
    hyb.observe(0, trace.expert_ids[0, 0])
    assert np.allclose(hyb.forecast(0, 2 * L).probs, K / E)


def test_a_trace_without_pregate_scores_is_refused():
    trace = _trace(1.0)
    bare = RoutingTrace(expert_ids=trace.expert_ids, request_offsets=trace.request_offsets, meta=trace.meta)
    with pytest.raises(UserError, match="--pregate"):
        PregatePredictor(bare)


@pytest.mark.parametrize("name", ["expertflow-style", "expertflow-style-pregate-only"])
def test_the_pregate_systems_replay_with_consistent_counts(name):
    from tests.sim.test_replay import replay

    train, test = _trace(3.0, seed=1), _trace(3.0, seed=2)
    _, m = replay(name, train, test, 0.5)
    assert m["activations"] == T * L * K and m["ready_rate"] + m["late_rate"] + m["miss_rate"] == pytest.approx(1.0)
    assert m["prefetches"] > 0


@pytest.mark.parametrize("name", ["expertflow-style", "expertflow-style-pregate-only"])
def test_a_batched_replay_gives_each_lane_its_own_tokens_pregate_rows(name):
    """In lockstep each lane's predictor reads the pre-gate rows of its own token (`TraceRows.tokens`),
    and the replay counts every activation."""
    from seqmoe.brain.manager import SystemInputs, build_system, start_placement
    from seqmoe.brain.predict.lanes import LanePredictors
    from seqmoe.brain.predict.pregate import TraceRows
    from seqmoe.sim import simulate
    from seqmoe.sim.lockstep import lockstep
    from tests.conftest import tiny_hardware, tiny_model

    train, test = _trace(3.0, seed=1), _trace(3.0, seed=2)
    lanes = LanePredictors(PregatePredictor(test))
    lanes.set_rows([0, 1])
    source = lanes.first.pregate_source
    source.tokens = [7, 40]
    lanes.begin_token(0, [None, None])
    lanes.observe(1, np.zeros((2, K), np.int64))
    for b, t in enumerate(source.tokens):
        fc = lanes.lane(b).predict(1)
        assert np.array_equal(fc.probs, TraceRows(test).rows[t * L + 1][:L - 2])
    C = 12
    system = build_system(name, SystemInputs(train=train, test=test, capacity=C, start=tuple(start_placement(train, C))),
                          "copy")
    c = simulate(test, system, model=tiny_model(test), hardware=tiny_hardware(), capacity=C,
                 start=start_placement(train, C), plan=lockstep(test, 2))
    assert c.ready + c.late + c.misses == T * L * K and c.prefetches > 0
    assert system.predictor.replay_tokens.tokens is None  # the replay leaves the rows as it found them


def test_systems_that_need_pregate_say_so_and_stay_out_of_the_default_lists():
    from seqmoe.brain.manager.systems import SystemInputs, baselines, build_system, live_systems

    bare = RoutingTrace(expert_ids=_trace(1.0).expert_ids, request_offsets=np.array([0, T]), meta=TraceMeta(num_experts=E))
    with pytest.raises(UserError, match="--pregate"):
        build_system("expertflow-style-pregate-only", SystemInputs(train=bare, test=bare, capacity=8, start=()))
    assert "expertflow-style-pregate-only" not in baselines() + live_systems(with_predictor=True)
    assert "seqmoe-hybrid" not in live_systems(with_predictor=True)

"""expertflow-style: the distance-wise history forecast, the adaptive prefetch distance, the two-level LRU.

Run: pytest tests/brain/schedule/test_expertflow.py -q
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.predict.baselines.expertflow import ExpertFlowPredictor
from seqmoe.brain.schedule.expertflow import AdaptiveHorizonPrefetcher, ExpertFlowShared, TwoLevelLRUPolicy
from seqmoe.trace.schema import RoutingTrace, TraceMeta

L, E = 4, 8


def _shifted_trace(tokens=400, seed=0) -> RoutingTrace:
    """K = 1: a token draws a, layer l uses (a + l) % E, so distance d within a token is exact."""
    a = np.random.default_rng(seed).integers(0, E, tokens)
    ids = ((a[:, None] + np.arange(L)[None, :]) % E).astype(np.int16)[:, :, None]
    return RoutingTrace(expert_ids=ids, request_offsets=np.array([0, tokens]), meta=TraceMeta(num_experts=E))


def test_the_forecast_is_fitted_at_each_distance():
    pred = ExpertFlowPredictor(_shifted_trace(), horizon=3, recent=1)
    pred.begin_request()
    pred.observe(0, np.array([5]))  # layer 0 of a token used expert 5
    fc = pred.predict(0)
    assert fc.steps.tolist() == [1, 2, 3]
    assert [int(np.argmax(row)) for row in fc.probs] == [6, 7, 0]  # layers 1, 2, 3: 5 + d mod 8
    assert fc.probs[1, 7] > 0.9


class _View:
    """A pool view with a fixed pace: layer `s` starts at s x layer_s; copies queue one after another."""

    def __init__(self, copy_s=1.0, layer_s=1.0):
        self.step, self.now, self.capacity, self.copy_time_s = 0, 0.0, 100, copy_s
        self.num_layers, self.num_experts, self.layer_s = L, E, layer_s
        self.issued: list[tuple[int, int]] = []
        self._free = 0.0

    def present(self, uid):
        return any(u == uid for u, _ in self.issued)

    def eta(self, step):
        return step * self.layer_s

    def backlog_end(self):
        return max(self._free, self.now)

    def prefetch(self, uid, deadline_step, victim=None):
        self.issued.append((uid, deadline_step))
        self._free = self.backlog_end() + self.copy_time_s
        return True


def _forecast(step, rows):
    from seqmoe.brain.predict.base import Forecast

    return Forecast(np.arange(step + 1, step + 1 + len(rows)), np.array(rows, dtype=np.float32))


def test_the_first_distance_covers_the_transfer_and_late_copies_push_it_further():
    shared = ExpertFlowShared(threshold=1)
    pf = AdaptiveHorizonPrefetcher(shared, mass=0.9)
    row = [1.0] + [0.0] * (E - 1)
    view = _View(copy_s=2.5, layer_s=1.0)  # one copy = 2.5 layers: the distance starts at 3
    pf.plan(_forecast(0, [row] * 6), view)
    assert pf.distance == 3 and view.issued == [(3 * E + 0, 3)]
    shared.unused.discard(3 * E)  # layer 3 used it...
    view.step, view.now = 3, 1.0  # ...revealed at t = 1, before the copy's estimated arrival (2.5)
    pf.plan(_forecast(3, [row] * 6), view)
    assert pf.distance == 4  # a stall: one layer further


def test_over_prefetch_brings_the_distance_closer_and_the_fixed_ablation_never_moves():
    shared = ExpertFlowShared(threshold=1)
    pf = AdaptiveHorizonPrefetcher(shared, mass=0.9)
    pf.distance = 3
    shared.over = 1  # a prefetched expert was evicted unused
    view = _View(copy_s=0.1)
    pf.plan(_forecast(0, [[1.0] + [0.0] * (E - 1)] * 6), view)
    assert pf.distance == 2
    fixed = AdaptiveHorizonPrefetcher(ExpertFlowShared(threshold=1), adaptive=False, fixed=2)
    fixed.shared.stalls = 5
    fixed.plan(_forecast(0, [[1.0] + [0.0] * (E - 1)] * 6), _View())
    assert fixed.distance == 2


def test_two_level_lru_evicts_unprotected_experts_first():
    shared = ExpertFlowShared(threshold=8)
    policy = TwoLevelLRUPolicy(shared, num_layers=L)
    policy.reset([])
    for uid, step in ((1, 0), (2, 1), (3, 9)):
        policy.insert(uid, step)
        policy.access(uid, step)
    policy.access(3, 10)
    assert policy.victim(-1, ()) == 1  # least recent, used 10 positions ago (> L)
    shared.predicted[1] = 12  # predicted for a later layer: protected
    assert policy.victim(-1, ()) == 2
    shared.predicted[2] = 12
    assert policy.victim(-1, ()) == 1  # everyone protected: plain LRU
    shared.unused.add(2)
    policy.remove(2)
    assert shared.over == 1  # prefetched, evicted before any use

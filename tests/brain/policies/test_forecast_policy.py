"""ForecastPolicy (probabilistic Belady) against exact Belady when the forecast is certain.

Run: pytest tests/brain/policies/test_forecast_policy.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqmoe.brain.policies import BeladyPolicy, FutureUses, belady_schedule
from seqmoe.brain.policies.belady import NEVER
from seqmoe.brain.policies.forecast import ForecastPolicy
from seqmoe.brain.policies.reuse import NUM_COUNT_CLASSES, decayed_count, fit_reuse_table
from seqmoe.brain.predict.base import Forecast
from seqmoe.brain.predict.baselines.oracle import OracleForecaster
from seqmoe.brain.manager.placement import start_placement, uid_counts
from seqmoe.trace.schema import RoutingTrace, TraceMeta
from tests.conftest import make_trace


def paging_with_certain_forecast(trace, train, capacity, horizon, tau):
    """Demand paging (a layer's K experts pinned together) with ForecastPolicy fed the true future.

    Belady runs in lockstep on the same state; at every eviction both victims are compared.

    Returns:
        (misses, [(ours next use, Belady's next use, horizon end)] per eviction).
    """
    uids = trace.uids()
    L, E = trace.num_layers, trace.num_experts
    future = FutureUses(uids, L * E)
    ours = ForecastPolicy(uid_counts(train) / train.num_tokens, num_layers=L, num_experts=E, tau=tau)
    belady, oracle = BeladyPolicy(future), OracleForecaster(trace, horizon)
    start = start_placement(train, capacity)
    ours.reset(start)
    belady.reset(start)
    resident, misses, evictions = set(start), 0, []
    ours.update(oracle.predict(-1), -1)
    for step, needed in enumerate(uids.reshape(-1, uids.shape[2]).tolist()):
        pinned = set(needed)
        for u in needed:
            if u in resident:
                ours.access(u, step)
                belady.access(u, step)
        for u in needed:
            if u in resident:
                continue
            misses += 1
            if len(resident) >= capacity:
                v, b = ours.victim(u, pinned), belady.victim(u, pinned)
                evictions.append((future.next_use(v, step), belady.next_use(b), step - 1 + horizon))
                for p in (ours, belady):
                    p.remove(v)
                resident.discard(v)
            resident.add(u)
            for p in (ours, belady):
                p.insert(u, step)
                p.access(u, step)
        ours.update(oracle.predict(step), step)  # the forecast made once the layer routed
    return misses, evictions


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), horizon=st.integers(1, 60), capacity=st.integers(2, 20))
def test_certain_forecast_evicts_what_belady_evicts_within_the_horizon(seed, horizon, capacity):
    train, trace = make_trace(seed=seed, num_tokens=60), make_trace(seed=seed + 1, num_tokens=60)
    _, evictions = paging_with_certain_forecast(trace, train, capacity, horizon, tau=4.0)
    for ours, belady, end in evictions:
        if belady <= end:  # Belady's victim is used within the horizon: the same next use
            assert ours == belady
        else:  # only "beyond the horizon" is known: ours is beyond it too
            assert ours > end


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(2, 20))
def test_misses_equal_belady_when_the_horizon_covers_the_trace(seed, capacity):
    train, trace = make_trace(seed=seed, num_tokens=50), make_trace(seed=seed + 1, num_tokens=50)
    horizon = trace.num_tokens * trace.num_layers
    misses, evictions = paging_with_certain_forecast(trace, train, capacity, horizon, tau=horizon / 20)
    start = start_placement(train, capacity)
    assert misses == len(belady_schedule(trace.uids(), capacity, start))
    assert all(o == b or (o == NEVER) == (b == NEVER) for o, b, _ in evictions)


def test_never_evicts_pinned_and_none_when_all_pinned():
    policy = ForecastPolicy(np.full(8, 0.25), num_layers=2, num_experts=4)
    policy.reset([0, 1, 2])
    assert policy.victim(5, {0, 1, 2}) is None
    for _ in range(20):
        assert policy.victim(5, {2}) in (0, 1)


def test_keep_value_prefers_likely_and_near_uses():
    L, E = 2, 4  # uids 0-3: layer 0, uids 4-7: layer 1
    policy = ForecastPolicy(np.full(L * E, 0.5), num_layers=L, num_experts=E, tau=4.0)
    policy.reset(list(range(L * E)))
    probs = np.array([[0.9, 0.0, 0.2, 0.0], [0.0, 0.0, 0.9, 0.0], [0.0, 0.9, 0.2, 0.0]])
    policy.update(Forecast(np.array([2, 3, 4]), probs), step=1)  # layers 0, 1, 0
    v = policy.keep_value(np.arange(L * E))
    assert v[0] > v[1]  # the same probability, nearer
    assert v[1] > v[2] > v[3]  # likely beats unlikely beats "certainly not within the horizon"
    assert v[6] > v[4] == v[5]
    policy.update(None, step=2)  # position 2 revealed: its row no longer counts
    assert policy.keep_value([0])[0] < v[0]


def test_ties_go_to_the_least_recently_used():
    policy = ForecastPolicy(np.full(4, 0.5), num_layers=1, num_experts=4)
    policy.reset([0, 1, 2, 3])  # most valuable first: 3 is the least recent
    assert policy.victim(9, set()) == 3
    policy.access(3, 0)
    assert policy.victim(9, set()) == 2


def test_cheapest_is_sorted_by_value_then_recency():
    policy = ForecastPolicy(np.array([0.9, 0.1, 0.5, 0.1]), num_layers=1, num_experts=4)
    policy.reset([0, 1, 2, 3])
    uids, values = policy.cheapest(3)
    assert uids.tolist() == [3, 1, 2] and np.all(np.diff(values) >= 0)


def test_rejects_wrong_use_rate_shape():
    with pytest.raises(ValueError, match="L \\* E"):
        ForecastPolicy(np.ones(5), num_layers=2, num_experts=4)


def _bursty_trace():
    """One layer, top-1: expert 0 in bursts of 4 tokens every 12; experts 1-3 take turns between."""
    t = np.arange(600)
    ids = np.where((t // 4) % 3 == 0, 0, 1 + t % 3).astype(np.int16)
    return RoutingTrace(expert_ids=ids[:, None, None], request_offsets=np.array([0, 600]),
                        meta=TraceMeta(num_experts=4))


def test_reuse_prior_tells_bursts_from_steady_use():
    table = fit_reuse_table(_bursty_trace(), tau=2.0, num_classes=1, num_gap_classes=6)
    age, gaps = np.ones(4, dtype=np.int64), np.array([1, 3, 3, 3])  # per uid: last two uses 1 or 3 tokens apart
    burst, steady = table.lookup(age, gaps)[:2]
    assert burst > steady  # a burst is likely to go on next token; steady use comes back in 3
    flat = fit_reuse_table(_bursty_trace(), tau=2.0, num_classes=1, num_gap_classes=1).lookup(age, gaps)
    assert flat[0] == flat[1]  # without gap classes the prior cannot tell them apart


def _phased_trace():
    """One layer, top-1, periods of 160 tokens: expert 0 every 3rd token in the first 40 (hot), then
    twice, 3 tokens apart, 60 tokens later (cold), then not until the next period. Its last gap is 3 in both."""
    t = np.arange(16000)
    phase = t % 160
    used = np.where(phase < 40, phase % 3 == 0, (phase == 100) | (phase == 103))
    ids = np.where(used, 0, 1).astype(np.int16)  # expert 1 between (its recent count stays high)
    return RoutingTrace(expert_ids=ids[:, None, None], request_offsets=np.array([0, len(t)]),
                        meta=TraceMeta(num_experts=2))


def test_reuse_prior_tells_a_hot_expert_from_a_cold_one_by_its_recent_count():
    kw = dict(tau=2.0, num_classes=1, num_gap_classes=6)
    table = fit_reuse_table(_phased_trace(), num_count_classes=NUM_COUNT_CLASSES, **kw)
    age, gaps = np.ones(2, dtype=np.int64), np.full(2, 3)
    hot, cold = 5.0, decayed_count(0.0, 3)  # many uses 3 tokens apart; a single earlier use

    def expert_0(t):
        return [t.lookup(age, gaps, np.array([count, 0.0]))[0] for count in (hot, cold)]

    v = expert_0(table)
    assert v[0] > 2 * v[1]  # a hot expert is used again in 2 tokens; a cold one waits out its period
    flat = expert_0(fit_reuse_table(_phased_trace(), **kw))
    assert flat[0] == flat[1]  # without count classes the prior cannot tell them apart


def test_reuse_table_refuses_an_unknown_number_of_count_classes():
    with pytest.raises(ValueError, match="num_count_classes"):
        fit_reuse_table(_phased_trace(), tau=2.0, num_count_classes=3)


def test_policy_tracks_the_recent_count():
    """Expert 0 with the same last use and last gap, after a hot stretch or a single earlier use."""
    values = []
    for steps in (range(0, 30, 3), (24, 27)):
        policy = ForecastPolicy.from_trace(_phased_trace(), tau=2.0)
        policy.reset([0, 1])
        for step in steps:
            policy.access(0, step)
        values.append(policy.keep_value(np.array([0]))[0])
    assert policy._recent[0] == decayed_count(0.0, 3)
    assert values[0] > values[1]


def test_policy_tracks_the_gap_between_the_last_two_uses():
    policy = ForecastPolicy.from_trace(_bursty_trace(), tau=2.0)
    policy.reset([0, 1])
    for step in (10, 11):  # uid 0: a burst
        policy.access(0, step)
    for step in (8, 11):  # uid 1: uses 3 tokens apart
        policy.access(1, step)
    v = policy.keep_value(np.array([0, 1]))
    assert v[0] > v[1]


def test_an_off_pool_use_counts_in_the_history_not_in_the_pool():
    """A miss served on the host CPU or read in place: the prior sees a recent use, no slot is taken."""
    L, E = 2, 4
    used, idle = (ForecastPolicy(np.full(L * E, 0.25), num_layers=L, num_experts=E) for _ in range(2))
    for p in (used, idle):
        p.reset([0, 1])
    used.note_use(5, 10)
    assert not used._resident[5] and used.victim(-1, ()) in (0, 1)
    assert used._last_use[5] == 10 and idle._last_use[5] == -1

"""Simulator invariants for every system.  Run: pytest tests/sim/test_replay.py -q"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqmoe.brain.policies import belady_misses, belady_schedule
from seqmoe.base.errors import UserError
from seqmoe.config import OffloadConfig, SimConfig
from seqmoe.brain.manager.placement import capacity_for, start_placement
from seqmoe.sim import simulate
from seqmoe.brain.manager.counts import summarize
from seqmoe.brain.manager.systems import SystemInputs, baselines, build_system
from tests.conftest import make_trace, tiny_hardware, tiny_model

DEMAND_ONLY = ("on-demand-lru", "on-demand-lfu", "mixtral-offloading-style")


def replay(name, train, test, residency, hw=None, predictor=None):
    C = capacity_for(residency, test.num_layers, test.num_experts)
    start = start_placement(train, C)
    system = build_system(name, SystemInputs(train=train, test=test, capacity=C, start=tuple(start), predictor=predictor))
    model = tiny_model(test)
    c = simulate(test, system, model=model, hardware=hw or tiny_hardware(), capacity=C, start=start)
    return c, summarize(c, expert_bytes=model.expert_bytes, belady_misses=belady_misses(test.uids(), C, start))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), residency=st.sampled_from([0.25, 0.4, 0.6, 0.9]))
def test_metric_invariants_for_every_system(seed, residency):
    train, test = make_trace(seed=seed), make_trace(seed=seed + 1, num_tokens=80)
    hits = {}
    for name in baselines():
        c, m = replay(name, train, test, residency)
        assert m["activations"] == test.num_tokens * test.num_layers * test.top_k
        assert m["ready_rate"] + m["late_rate"] + m["miss_rate"] == pytest.approx(1.0)
        assert m["hit_rate"] == pytest.approx(m["ready_rate"] + m["late_rate"])
        assert 0 < m["bound_fraction"] <= 1 + 1e-12
        assert m["full_load_fraction"] <= 1 + 1e-12
        assert m["copies"] >= m["misses"] >= m["belady_misses"] - (m["prefetches"] if name != "belady" else 0)
        assert m["time_s"] >= m["full_load_time_s"] - 1e-12
        if c.prefetches == 0:
            assert c.late == 0 and c.wasted_copies == 0
        hits[name] = m["hit_rate"]
    assert all(hits["belady"] >= hits[n] - 1e-12 for n in DEMAND_ONLY)


def test_full_residency_never_misses():
    train, test = make_trace(seed=3), make_trace(seed=4)
    for name in baselines():
        c, m = replay(name, train, test, 1.0)
        assert c.misses == 0 and c.copies == 0 and m["full_load_fraction"] == pytest.approx(1.0)


def test_oracle_with_unlimited_bandwidth_hits_everything_and_copies_what_belady_copies():
    train, test = make_trace(seed=5), make_trace(seed=6, num_tokens=200)
    fast = tiny_hardware(h2d_bytes_per_s=1e30, copy_overhead_s=0.0)
    c, m = replay("oracle-prefetch", train, test, 0.5, hw=fast)
    assert c.misses == 0 and c.late == 0 and m["hit_rate"] == 1.0
    C = capacity_for(0.5, test.num_layers, test.num_experts)
    assert c.copies == len(belady_schedule(test.uids(), C, start_placement(train, C)))
    b, _ = replay("belady", train, test, 0.5, hw=fast)
    assert c.copies == b.misses  # same copies, issued ahead instead of on demand


def test_oracle_is_at_least_as_fast_as_demand_belady():
    train, test = make_trace(seed=7), make_trace(seed=8, num_tokens=300)
    for hw in (tiny_hardware(h2d_bytes_per_s=1e9), tiny_hardware(h2d_bytes_per_s=1e11)):
        _, o = replay("oracle-prefetch", train, test, 0.4, hw=hw)
        _, b = replay("belady", train, test, 0.4, hw=hw)
        assert o["time_s"] <= b["time_s"] + 1e-12
        assert o["bound_fraction"] >= b["bound_fraction"] - 1e-12


def test_demand_only_lru_has_no_late_hits_and_stalls_one_copy_per_missed_layer_at_most():
    train, test = make_trace(seed=9), make_trace(seed=10)
    c, m = replay("on-demand-lru", train, test, 0.3)
    assert c.late == 0 and c.prefetches == 0
    # Each miss costs at most one copy of stall (copies of a layer queue behind each other).
    assert c.stall_s <= c.misses * c.copy_time_s + 1e-9


def test_replay_is_deterministic():
    train, test = make_trace(seed=11), make_trace(seed=12)
    for name in baselines():
        a, _ = replay(name, train, test, 0.4)
        b, _ = replay(name, train, test, 0.4)
        assert (a.ready, a.late, a.misses, a.copies, a.time_s) == (b.ready, b.late, b.misses, b.copies, b.time_s)


def test_capacity_below_top_k_and_bad_residency_are_user_errors():
    train = test = make_trace(num_layers=1, num_experts=8, top_k=4)
    with pytest.raises(UserError, match="top-4"):
        replay("on-demand-lru", train, test, 3 / 8)
    for r in (0.0, -0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(UserError, match="residency"):
            SimConfig(trace="t.safetensors", residency=r)
        with pytest.raises(UserError, match="residency"):
            OffloadConfig(residency=r)


def test_profile_mismatch_is_a_user_error():
    test = make_trace()
    model = tiny_model(make_trace(num_experts=16))
    system = build_system("on-demand-lru", SystemInputs(train=test, test=test, capacity=8, start=()))
    with pytest.raises(UserError, match="E=8"):
        simulate(test, system, model=model, hardware=tiny_hardware(), capacity=8, start=[])


def test_start_placement_is_most_used_first_ties_by_lower_uid():
    ids = np.array([[[0]], [[2]], [[2]], [[1]], [[3]]], dtype=np.int16)  # L=1, K=1, E=4
    from seqmoe.trace.schema import RoutingTrace, TraceMeta

    t = RoutingTrace(expert_ids=ids, request_offsets=np.array([0, 5]), meta=TraceMeta(num_experts=4))
    assert start_placement(t, 3) == [2, 0, 1]


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000))
def test_prefetching_systems_run_with_only_top_k_slots(seed):
    """At C = K a prefetch in flight can pin the one slot a demand copy needs: the demand copy waits
    for it to land (it would queue behind it anyway) and evicts it, a wasted copy."""
    train, test = make_trace(seed=seed), make_trace(seed=seed + 1, num_tokens=60)
    residency = test.top_k / (test.num_layers * test.num_experts)
    for name in baselines():  # each used to stop with "slots are all copying" on some of these traces
        c, m = replay(name, train, test, residency)
        assert m["activations"] == test.num_tokens * test.num_layers * test.top_k
        assert m["ready_rate"] + m["late_rate"] + m["miss_rate"] == pytest.approx(1.0)
        assert m["copies"] >= m["misses"] and m["time_s"] >= m["full_load_time_s"] - 1e-12

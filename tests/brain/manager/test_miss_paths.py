"""Miss paths (copy, in-place, host CPU, auto): counts, the driver's clock, and the bound that must
hold for every system whatever path it takes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqmoe.brain.policies.belady import FutureUses, belady_misses
from seqmoe.base.errors import UserError
from seqmoe.brain.manager import SystemInputs, build_system, start_placement
from seqmoe.brain.manager.miss_paths import check_miss, paths_bound_time_s
from seqmoe.brain.manager.systems import system_spec
from seqmoe.sim import simulate
from seqmoe.brain.manager.counts import summarize
from seqmoe.costs.profiles import layer_times_s
from tests.conftest import make_trace, tiny_hardware, tiny_model

HOST = dict(host_memory_bytes_per_s=100e9, host_cores=8)


def _belady(seq: list[int], capacity: int) -> int:
    uids = np.asarray(seq, dtype=np.int64).reshape(-1, 1, 1)
    return belady_misses(uids, capacity, [], FutureUses(uids, max(seq) + 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=40), st.integers(1, 4), st.data())
def test_removing_one_access_lowers_belady_by_at_most_two(seq, capacity, data):
    i = data.draw(st.integers(0, len(seq) - 1))
    short = seq[:i] + seq[i + 1:]
    assert _belady(short, capacity) >= _belady(seq, capacity) - 2


def _run(trace, name: str, miss: str, hw, residency: float = 0.3):
    train = make_trace(seed=9, num_layers=trace.num_layers, num_experts=trace.num_experts, top_k=trace.top_k)
    L, E = trace.num_layers, trace.num_experts
    C = max(trace.top_k, int(residency * L * E))
    start = start_placement(train, C)
    system = build_system(name, SystemInputs(train=train, test=trace, capacity=C, start=tuple(start)), miss)
    model = tiny_model(trace)
    counts = simulate(trace, system, model=model, hardware=hw, capacity=C, start=start)
    n_opt = belady_misses(trace.uids(), C, start)
    return {"miss": system.miss, **summarize(counts, expert_bytes=model.expert_bytes, belady_misses=n_opt)}


RUNS = [("on-demand-lru", m) for m in ("copy", "in-place", "cpu", "auto")] + [
    ("cpu-all", "copy"), ("static-split-style", "copy"), ("seqmoe-prior-eviction", "auto"),
    ("seqmoe-markov-forecast", "auto"), ("oracle-prefetch", "copy"), ("belady", "in-place")]


@pytest.mark.parametrize("host_s", [2e-5, 1e-4, 1e-3])  # faster than a copy (1.1e-4), about as fast, far slower
@pytest.mark.parametrize("seed", [0, 1])
def test_paths_bound_holds_for_every_system_and_path(seed, host_s):
    trace = make_trace(seed=seed, num_tokens=80)
    # host_cores x 13 GB/s per core caps the rate: pick the memory bandwidth that gives `host_s`.
    rate = 1e6 / (host_s - 1e-5)
    hw = dataclasses.replace(tiny_hardware(), host_cores=10**6, host_memory_bytes_per_s=rate / (0.82 * 0.75))
    for name, miss in RUNS:
        row = _run(trace, name, miss, hw)
        assert row["time_s"] >= row["paths_bound_time_s"] * (1 - 1e-9), (name, miss)
        if miss == "copy" and system_spec(name).miss is None:  # the copy-only bound holds for copy-only systems
            assert row["time_s"] >= row["bound_time_s"] * (1 - 1e-9), (name, miss)


def test_counts_split_the_misses_by_path():
    trace = make_trace(seed=3)
    hw = dataclasses.replace(tiny_hardware(), **HOST)
    copy = _run(trace, "on-demand-lru", "copy", hw)
    inplace = _run(trace, "on-demand-lru", "in-place", hw)
    cpu = _run(trace, "on-demand-lru", "cpu", hw)
    assert copy["misses_in_place"] == copy["misses_cpu"] == 0 and copy["copies"] == copy["misses"]
    # Nothing is ever copied in: the start placement stays, so both off-pool paths miss alike.
    assert inplace["copies"] == cpu["copies"] == 0
    assert inplace["misses"] == inplace["misses_in_place"] == cpu["misses"] == cpu["misses_cpu"]
    assert inplace["bytes_read_in_place"] == inplace["misses"] * tiny_model(trace).expert_bytes
    every = _run(trace, "cpu-all", "copy", hw)
    assert every["miss"] == "cpu" and every["misses_cpu"] == every["activations"] and every["copies"] == 0


def test_auto_takes_the_faster_way():
    trace = make_trace(seed=4)
    slow_cpu = dataclasses.replace(tiny_hardware(), host_memory_bytes_per_s=1e8, host_cores=1)  # 10 ms per expert
    row = _run(trace, "on-demand-lru", "auto", slow_cpu)
    assert row["misses_cpu"] == 0 and row["copies"] == row["misses"]
    fast_cpu = dataclasses.replace(tiny_hardware(), host_memory_bytes_per_s=1e15, host_cores=10**6)  # overhead only
    row = _run(trace, "on-demand-lru", "auto", fast_cpu)
    assert row["misses_cpu"] == row["misses"] > 0
    assert row["time_s"] < _run(trace, "on-demand-lru", "copy", fast_cpu)["time_s"]


def test_host_experts_overlap_the_device_and_end_the_layer():
    trace = make_trace(seed=5, num_tokens=30)
    host_s = 5e-3  # far longer than a layer: every layer waits for its host experts
    hw = dataclasses.replace(tiny_hardware(), host_cores=10**6, host_memory_bytes_per_s=1e6 / (host_s - 1e-5) / 0.615)
    row = _run(trace, "cpu-all", "copy", hw)
    activations = trace.num_tokens * trace.num_layers * trace.top_k
    _, per_expert = layer_times_s(tiny_model(trace), hw)
    # Full load with each expert's device time replaced by its (serial) host time.
    assert row["time_s"] == pytest.approx(row["full_load_time_s"] + activations * (host_s - per_expert), rel=1e-6)
    assert row["stall_s"] == pytest.approx(activations * host_s, rel=1e-6)


def test_without_a_host_the_cpu_path_is_refused():
    trace = make_trace()
    with pytest.raises(UserError, match="describes no host"):
        _run(trace, "on-demand-lru", "cpu", tiny_hardware())
    with pytest.raises(UserError, match="describes no host"):
        _run(trace, "cpu-all", "copy", tiny_hardware())
    row = _run(trace, "on-demand-lru", "auto", tiny_hardware())  # auto: copy or in-place only
    assert row["misses_cpu"] == 0
    with pytest.raises(UserError, match="unknown miss path"):
        check_miss("gpu")


def test_the_paths_bound_without_a_cpu_halves_the_link_term():
    kw = dict(full_load_time_s=1.0, activations=100, per_expert_s=0.001, copy_time_s=0.1, belady_misses=31)
    assert paths_bound_time_s(host_expert_s=None, **kw) == pytest.approx(1.6)  # 0.1 x ceil(31 / 2)
    # A CPU as fast as the device takes work off the link until the three terms balance.
    assert paths_bound_time_s(host_expert_s=0.001, **kw) < 1.6
    assert paths_bound_time_s(host_expert_s=0.001, **kw) >= 1.0 - 0.001 * 100

"""The low-bit twin miss path: which misses it serves, what the link charges for them, and the
compiled manager making the reference's decisions with it.
Run: pytest tests/brain/manager/test_twin.py -q
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from seqmoe.base.errors import UserError
from seqmoe.brain.manager import Driver, SystemInputs, build_manager, build_system, capacity_for, start_placement
from seqmoe.brain.manager.miss_paths import DEFAULT_TWIN_BUDGET, Twin, check_twin, pick_twins
from seqmoe.costs.profiles import copy_time_s
from seqmoe.sim import simulate
from seqmoe.sim.lockstep import lockstep
from tests.conftest import make_trace, tiny_hardware, tiny_model

SHAPE = dict(num_layers=4, num_experts=16, top_k=3)


def _with_gates(trace, seed: int):
    """`trace` with random gate weights (each position's K weights summing to 1, as a top-k softmax)."""
    rng = np.random.default_rng(seed)
    w = rng.dirichlet(np.ones(trace.top_k), size=trace.expert_ids.shape[:2]).astype(np.float32)
    return dataclasses.replace(trace, gate_weights=w)


def test_pick_twins_takes_the_smallest_weights_while_the_budget_holds():
    missing = np.array([True, False, True, True])
    weights = np.array([0.3, 0.05, 0.2, 0.5])
    assert pick_twins(missing, weights, 0.55).tolist() == [True, False, True, False]
    assert pick_twins(missing, weights, 0.19).tolist() == [False] * 4  # the smallest miss alone is over
    assert pick_twins(missing, weights, np.inf).tolist() == [True, False, True, True]  # hits never
    assert not pick_twins(np.zeros(4, bool), weights, np.inf).any()


def test_check_twin_explains_bad_values():
    assert check_twin(None, None) is None
    assert check_twin("int4", None) == Twin("int4", DEFAULT_TWIN_BUDGET)
    for precision, budget, says in ((None, 0.3, "give its precision"), ("int2", None, "unknown twin precision"),
                                    ("int4", -1.0, ">= 0"), ("int4", float("nan"), ">= 0")):
        with pytest.raises(UserError, match=says):
            check_twin(precision, budget)


HOST_HW = dataclasses.replace(tiny_hardware(3e9), host_memory_bytes_per_s=5e9, host_cores=8)


def _manager(twin, capacity=3, system="on-demand-lru", model=None, compiled=False, miss="copy", hw=None):
    trace = make_trace(num_tokens=4, num_layers=1, num_experts=8, top_k=3)
    inputs = SystemInputs(train=trace, test=trace, capacity=capacity, start=())
    hw = hw or (tiny_hardware() if system != "cpu-all" else HOST_HW)
    return build_manager(build_system(system, inputs, miss, twin), model=model or tiny_model(trace),
                         hardware=hw, capacity=capacity, start=[], compiled=compiled)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_twin_read_holds_the_link_for_the_twins_bytes_and_takes_no_slot(compiled):
    m = _manager(Twin("int4", 0.25), compiled=compiled)
    d = Driver(m)
    d.token_start(None, True)
    reveal = d.clock + m.non_expert_s
    d.reveal(0, np.array([0, 1, 2]), weights=np.array([0.5, 0.2, 0.3]))
    twin_s = copy_time_s(tiny_model(make_trace(num_layers=1, num_experts=8, top_k=3)).at_precision("int4"),
                         tiny_hardware())
    assert twin_s < 0.5 * m.copy_time_s
    # Expert 1 (weight 0.2) fits the budget, expert 2 (0.3 more) does not: two copies, one twin read.
    assert d.clock == pytest.approx(reveal + 2 * m.copy_time_s + twin_s)
    d.layer_end(0)
    c = d.counts()
    assert (c.misses, c.twin, c.twin_weight) == (3, 1, pytest.approx(0.2))
    assert m.present_mask()[[0, 1, 2]].tolist() == [1, 0, 1]
    # The budget is per token: the next token's smallest miss is served by its twin again.
    d.token_start(None, False)
    d.reveal(0, np.array([3, 4, 5]), weights=np.array([0.1, 0.6, 0.3]))
    d.layer_end(0)
    c = d.finish()
    assert (c.twin, c.copies) == (2, 4)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("host_bw,twins", [(1e12, 0), (1e8, 1)])
def test_where_the_host_cpu_would_finish_first_the_miss_goes_there_unspent(compiled, host_bw, twins):
    """miss="auto": the twin-eligible miss (weight 0.2) goes to a host CPU faster than its twin read,
    keeping the budget; a slow host leaves it to the twin."""
    hw = dataclasses.replace(tiny_hardware(), host_memory_bytes_per_s=host_bw, host_cores=64)
    m = _manager(Twin("int4", 0.25), compiled=compiled, miss="auto", hw=hw)
    d = Driver(m)
    d.token_start(None, True)
    d.reveal(0, np.array([0, 1, 2]), weights=np.array([0.5, 0.2, 0.3]))
    c = d.counts()
    assert (c.twin, c.twin_weight) == (twins, pytest.approx(0.2 * twins))
    assert c.host >= 1 - twins


def test_a_twin_must_be_smaller_than_the_store_and_needs_weights():
    trace = make_trace(num_layers=1, num_experts=8, top_k=3)
    with pytest.raises(UserError, match="not smaller"):
        _manager(Twin("int8", 1.0), model=tiny_model(trace).at_precision("int8"))
    with pytest.raises(UserError, match="no miss to serve"):
        _manager(Twin("int4", 1.0), system="cpu-all")
    d = Driver(_manager(Twin("int4", 1.0)))
    d.token_start(None, True)
    with pytest.raises(UserError, match="gate weights"):
        d.reveal(0, np.array([0, 1, 2]))


def test_simulate_asks_for_gate_weights():
    trace = make_trace(**SHAPE)
    system = build_system("on-demand-lru", SystemInputs(train=trace, test=trace, capacity=12, start=()), "copy",
                          Twin("int4", 1.0))
    with pytest.raises(UserError, match="gate weights"):
        simulate(trace, system, model=tiny_model(trace), hardware=tiny_hardware(), capacity=12, start=[])


def _both(name, seed, r, miss, budget, batch=1):
    train = make_trace(num_tokens=300, seed=seed + 50, **SHAPE)
    test = _with_gates(make_trace(num_tokens=160, seed=seed, **SHAPE), seed)
    C = capacity_for(r, test.num_layers, test.num_experts, test.top_k)
    start = start_placement(train, C)
    inputs = SystemInputs(train=train, test=test, capacity=C, start=tuple(start))
    out = []
    for compiled in (False, True):
        c = simulate(test, build_system(name, inputs, miss, Twin("int4", budget)), model=tiny_model(test),
                     hardware=HOST_HW, capacity=C, start=start, compiled=compiled,
                     plan=lockstep(test, batch) if batch > 1 else None)
        out.append({k: v for k, v in dataclasses.asdict(c).items() if k != "decision_s"})
    return out


@pytest.mark.parametrize("budget", [0.0, 0.4, 1.5])
@pytest.mark.parametrize("miss", ["copy", "auto"])
@pytest.mark.parametrize("name", ["on-demand-lru", "seqmoe-markov-forecast"])
@pytest.mark.parametrize("seed,r", [(0, 0.2), (1, 0.45)])
def test_compiled_equals_reference_with_twins(name, miss, budget, seed, r):
    ref, fast = _both(name, seed, r, miss, budget)
    assert fast == ref
    assert (ref["twin"] > 0) == (budget > 0)
    assert ref["twin_weight"] <= budget * ref["num_tokens"] + 1e-9


@pytest.mark.parametrize("budget", [0.4, 1.5])
@pytest.mark.parametrize("miss", ["copy", "auto"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_batch_spends_its_rows_budgets_on_twins_alike_compiled_or_not(miss, budget, seed):
    """At batch B a step spends B tokens' budgets, a twin costing its gate weight in every row routing it:
    the gate weight twins serve per token stays within the budget."""
    ref, fast = _both("on-demand-lru", seed, 0.2, miss, budget, batch=4)
    assert fast == ref
    assert ref["twin"] > 0 and ref["twin_weight"] <= budget * ref["num_tokens"] + 1e-9
    assert ref["misses"] > ref["twin"]  # shared misses count once per activation, their twin read once


def test_summed_per_uid_adds_a_shared_experts_weights():
    from seqmoe.brain.manager.driver import distinct_uids, summed_per_uid

    flat = np.array([5, 2, 9, 2, 5, 7])
    uids, _ = distinct_uids(flat)
    assert uids.tolist() == [5, 2, 9, 7]
    assert summed_per_uid(flat, uids, np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])).tolist() == pytest.approx([0.6, 0.6, 0.3, 0.6])


def test_twins_save_copies_and_time_against_no_twins():
    none, some = (_both("on-demand-lru", 2, 0.25, "copy", b)[0] for b in (0.0, 1.0))
    assert some["twin"] > 0 and some["copies"] < none["copies"]
    assert some["time_s"] < none["time_s"]

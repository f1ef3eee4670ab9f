"""The runtime decides what the simulator decides: replaying `runtime.trace()` with `simulate`
(same system, capacity, start placement, cost model) gives the same counts.

Run: pytest tests/runtime/test_fidelity.py -q
"""

from __future__ import annotations

import pytest
import torch

from seqmoe.brain.manager.systems import live_systems
from seqmoe.runtime import offload
from seqmoe.sim import simulate
from seqmoe.brain.manager.systems import SystemInputs, build_system
from tests.runtime.conftest import TEST_HW, fresh, greedy, logits, reference

PROMPTS = ([1, 8, 77, 21], [1, 50, 3, 3, 91, 14, 60, 2, 19])


def _run(arch: str, system: str, residency: float, *, train=True, **kw):
    ref = reference(arch)
    model = fresh(arch)
    rt = offload(model, residency, system, train=ref.train if train else None, hardware=TEST_HW, **kw)
    for p in PROMPTS:  # two generate requests, then one plain forward (a third request)
        greedy(model, p, 6)
    logits(model)
    return rt, ref


def _replay(rt, train):
    trace = rt.trace()
    system = build_system(rt.system, SystemInputs(train=train or trace, test=trace, capacity=rt.capacity,
                                                  start=tuple(rt.start)), rt.miss)
    return trace, simulate(trace, system, model=rt.model_profile, hardware=rt.hardware, capacity=rt.capacity,
                           start=rt.start)


@pytest.mark.parametrize("control", ["inline", "thread"])
@pytest.mark.parametrize("system", live_systems())
def test_counts_equal_the_simulators(system, control):
    rt, ref = _run("olmoe", system, 0.3, control=control)
    trace, c = _replay(rt, ref.train)
    s = rt.stats()
    assert trace.num_requests == 3
    assert trace.num_tokens == s["tokens"] == sum(len(p) + 5 for p in PROMPTS) + 7
    got = (s["ready"], s["late"], s["misses"], s["prefetches"], s["wasted_copies"], s["cancelled_prefetches"])
    assert got == (c.ready, c.late, c.misses, c.prefetches, c.wasted_copies, c.cancelled)
    assert s["sim_time_s"] == pytest.approx(c.time_s, rel=1e-12)
    # nothing on the virtual clock is named like a measurement (a speed, a time) without its sim_ prefix
    clock = [k for k in s if k.endswith(("_s", "tokens_per_s", "full_load_fraction")) and not k.startswith("sim_")]
    assert clock == [], clock
    rt.restore()


@pytest.mark.parametrize("control", ["inline", "thread"])
def test_a_prefetching_system_runs_with_only_top_k_slots(control):
    """3 x 8 experts, top-2, residency 0.1: 2 slots, so a prefetch in flight can hold the slot a
    demand copy needs (the simulator then lets it land and evicts it)."""
    rt, ref = _run("mixtral", "affinity-style", 0.1, control=control)
    assert rt.capacity == 2
    assert torch.equal(greedy(rt.model), ref.tokens)
    trace, c = _replay(rt, ref.train)
    s = rt.stats()
    assert (s["ready"], s["late"], s["misses"], s["prefetches"], s["wasted_copies"]) == (
        c.ready, c.late, c.misses, c.prefetches, c.wasted_copies)
    assert s["prefetches"] > 0
    rt.restore()


def test_prefetching_system_has_ready_and_late_hits():
    """The test cost model exercises every kind of activation, so the equality above means something."""
    rt, ref = _run("olmoe", "affinity-style", 0.3)
    s = rt.stats()
    assert s["ready"] > 0 and s["late"] > 0 and s["misses"] > 0 and s["prefetches"] > 0
    rt.restore()


@pytest.mark.parametrize("control", ["inline", "thread"])
def test_counts_equal_without_train_and_with_a_lagging_worker(control):
    rt, _ = _run("mixtral", "on-demand-lru", 0.25, train=False, bandwidth=2e7, emulate_link=True, control=control)
    assert rt.start == []
    _, c = _replay(rt, None)
    s = rt.stats()
    assert (s["ready"], s["late"], s["misses"]) == (c.ready, c.late, c.misses)
    rt.synchronize()
    s = rt.stats()
    assert s["copies"] + s["skipped_copies"] == s["misses"]  # each demand copy ran once or was dropped as stale
    assert s["skipped_copies"] > 0  # the worker lagged: some experts were evicted before their copy ran
    rt.restore()


def test_trace_holds_the_routing_the_model_used():
    """The runtime's trace equals what `seqmoe.arch.collect` records for the same requests."""
    from seqmoe.arch.collect import collect_trace

    ref = reference("qwen3_moe")
    model = fresh("qwen3_moe")
    rt = offload(model, 0.5, "on-demand-lru")
    out = greedy(model, PROMPTS[1], 6)
    trace = rt.trace()
    rt.restore()
    collected = collect_trace(ref.model, [out[0, :-1].tolist()], mode="prompt")
    assert (trace.expert_ids == collected.expert_ids).all()
    assert trace.token_ids.tolist() == out[0, :-1].tolist()
    assert torch.allclose(torch.from_numpy(trace.gate_weights), torch.from_numpy(collected.gate_weights), atol=1e-6)


@pytest.mark.parametrize("control", ["inline", "thread"])
def test_a_runtime_without_a_trace_keeps_none_and_counts_the_same(control):
    """record_trace=False (a server's): the same tokens and counts, no routing kept, and trace() says why."""
    from seqmoe.base.errors import UserError

    runs = []
    for record in (True, False):
        model = fresh("qwen3_moe")
        rt = offload(model, 0.5, "on-demand-lru", control=control, record_trace=record)
        out = greedy(model, PROMPTS[1], 6)
        runs.append((out.tolist(), rt.stats()))
        if not record:
            assert not rt.controller._ids and not rt.controller._tokens
            with pytest.raises(UserError, match="record_trace=False"):
                rt.trace()
        rt.restore()
    (out_a, s_a), (out_b, s_b) = runs
    assert out_a == out_b
    counts = ("tokens", "ready", "late", "misses", "sim_copies")  # the copies run can be skipped by timing
    assert [s_a[k] for k in counts] == [s_b[k] for k in counts]


def test_a_live_online_run_replays_in_the_simulator_with_its_swaps(monkeypatch, tmp_path):
    """seqmoe learning online (a child process, swaps when its rounds are ready): its trace replayed
    with the same (snapshot, swap) tokens, the same rounds trained in-process, counts the same."""
    import numpy as np

    from seqmoe.brain.predict.online import InlineLearner, OnlineForecaster, cold_prior, online_config
    from seqmoe.brain.predict.train import OnlineTrainer

    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path))
    model = fresh("olmoe")
    rt = offload(model, 0.3, "seqmoe", hardware=TEST_HW)
    fc = rt.controller.system.predictor
    greedy(model, PROMPTS[1], 150)  # past the first snapshot (128 tokens)
    assert fc.learner.wait(120)  # the child's first round is done: it is swapped in at the next token
    greedy(model, PROMPTS[0], 40)
    trace, s, swaps = rt.trace(), rt.stats(), list(fc.swaps)
    rt.restore()
    assert len(swaps) == 1 and swaps[0][0] == 128
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    cfg = online_config(L, E, K)
    replay = OnlineForecaster(cfg, InlineLearner(OnlineTrainer(cfg)), replay=swaps)
    system = build_system("seqmoe", SystemInputs(train=trace, test=trace, capacity=rt.capacity, start=(),
                                                  predictor=replay, prior=cold_prior(L, E, K)), rt.miss)
    c = simulate(trace, system, model=rt.model_profile, hardware=rt.hardware, capacity=rt.capacity, start=[])
    assert replay.swaps == swaps
    got = (s["ready"], s["late"], s["misses"], s["prefetches"], s["wasted_copies"])
    assert got == (c.ready, c.late, c.misses, c.prefetches, c.wasted_copies)
    assert np.isclose(s["sim_time_s"], c.time_s, rtol=1e-12)

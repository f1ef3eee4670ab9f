"""The compiled manager makes the reference state machine's decisions, count for count.

Every compilable system is replayed by both managers on random traces at several residencies and
link speeds (including C = K, where a demand copy waits for a running prefetch); the counts,
stall and simulated time must be equal, and so must the observer's calls.
Run: pytest tests/brain/manager/test_compiled.py -q
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from seqmoe.brain.policies.forecast import ForecastPolicy
from seqmoe.brain.manager import SystemInputs, build_manager, build_system, capacity_for, start_placement
from seqmoe.brain.manager.compiled import CompiledManager, compilable
from seqmoe.brain.manager.compiled import _build_dir
from seqmoe.brain.manager.base import System
from seqmoe.brain.manager.state import MemoryManager
from seqmoe.brain.manager.systems import SYSTEMS
from seqmoe.brain.predict.baselines.affinity import AffinityPredictor
from seqmoe.brain.predict.baselines.oracle import OracleForecaster
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.brain.schedule.deadline import DeadlinePrefetcher
from seqmoe.sim import simulate
from tests.conftest import drive, make_trace, tiny_hardware, tiny_model

CASES = [(seed, r, bw) for seed in (0, 1, 2) for r in (0.2, 0.4, 0.7) for bw in (3e9, 3e10)]
SHAPE = dict(num_layers=4, num_experts=16, top_k=3)


def _hardware(bw, host_bw=None):
    """The tiny profile at link speed `bw`, with a host CPU of memory bandwidth `host_bw` when given."""
    hw = tiny_hardware(bw)
    return hw if host_bw is None else dataclasses.replace(hw, host_memory_bytes_per_s=host_bw, host_cores=8)


def _counts(trace, system_of, capacity, start, bw, compiled, host_bw=None):
    c = simulate(trace, system_of(), model=tiny_model(trace), hardware=_hardware(bw, host_bw), capacity=capacity,
                 start=start, compiled=compiled)
    return {k: v for k, v in dataclasses.asdict(c).items() if k != "decision_s"}


def _both(name, seed, r, bw, predictor=None, system_of=None, miss="copy", host_bw=None):
    train = make_trace(num_tokens=300, seed=seed + 50, **SHAPE)
    test = make_trace(num_tokens=160, seed=seed, **SHAPE)
    C = capacity_for(r, test.num_layers, test.num_experts, test.top_k)
    start = start_placement(train, C)
    inputs = SystemInputs(train=train, test=test, capacity=C, start=tuple(start), predictor=predictor)
    system_of = system_of or (lambda: build_system(name, inputs, miss))
    assert compilable(system_of())
    return [_counts(test, system_of, C, start, bw, compiled, host_bw) for compiled in (False, True)]


@pytest.mark.parametrize("name", ["on-demand-lru", "seqmoe-markov-forecast"])
@pytest.mark.parametrize("seed,r,bw", CASES)
def test_compiled_equals_reference(name, seed, r, bw):
    ref, fast = _both(name, seed, r, bw)
    assert fast == ref
    assert ref["prefetches"] > 0 or name == "on-demand-lru"


@pytest.mark.parametrize("replan", [False, True])
@pytest.mark.parametrize("seed,r,bw", CASES[::3])
def test_compiled_equals_reference_with_certain_forecasts(seed, r, bw, replan):
    """The true next two tokens as the forecast (one-hot rows, certain entries); with and without
    the scheduler's plan after each layer's compute."""
    def system_of():
        train = make_trace(num_tokens=300, seed=seed + 50, **SHAPE)
        policy = ForecastPolicy.from_trace(train)
        test = make_trace(num_tokens=160, seed=seed, **SHAPE)
        return System("oracle-2-tokens", policy, OracleForecaster(test, 2 * test.num_layers),
                      DeadlinePrefetcher(policy, replan_after_compute=replan))

    ref, fast = _both("oracle-2-tokens", seed, r, bw, system_of=system_of)
    assert fast == ref


@pytest.mark.parametrize("name,draft", [("seqmoe", "none"), ("seqmoe-lru-eviction", "none"), ("seqmoe-no-far-head", "none"),
                                        ("seqmoe-no-far-head", "ngram"), ("seqmoe-oracle-draft", "none")])
def test_compiled_equals_reference_with_the_trained_forecaster(name, draft, tiny_forecaster):
    """seqmoe with the forecaster's long-range head, without it, with drafts (two-token forecast)."""
    d, train, test = tiny_forecaster
    if draft != "none" or name == "seqmoe-oracle-draft":  # token ids whose n-grams recur
        test = dataclasses.replace(test, token_ids=np.resize(np.array([1, 2, 3, 4, 2, 3, 5], np.int32), test.num_tokens))
    pred = load_seq_predictor(d / "pred")
    for r, bw in ((0.3, 3e9), (0.6, 3e10), (0.25, 1e9)):
        C = capacity_for(r, test.num_layers, test.num_experts, test.top_k)
        start = start_placement(train, C)
        inputs = SystemInputs(train=train, test=test, capacity=C, start=tuple(start), predictor=pred, draft=draft)
        ref, fast = (_counts(test, lambda: build_system(name, inputs), C, start, bw, compiled) for compiled in (False, True))
        assert fast == ref
    if name == "seqmoe-oracle-draft":  # batched: each lane drafts its own token's next
        from seqmoe.sim import simulate
        from seqmoe.sim.lockstep import lockstep

        system = build_system(name, inputs)
        c = simulate(test, system, model=tiny_model(test), hardware=tiny_hardware(), capacity=C, start=start,
                     plan=lockstep(test, 3))
        assert c.ready + c.late + c.misses == test.num_tokens * test.num_layers * test.top_k
        assert system.predictor.replay_tokens.tokens is None


# A host CPU faster than either link (1.6e-5 s per expert) and one slower than the fast link (3.3e-4 s).
@pytest.mark.parametrize("host_bw", [100e9, 5e9])
@pytest.mark.parametrize("miss", ["in-place", "cpu", "auto"])
@pytest.mark.parametrize("name", ["on-demand-lru", "seqmoe-markov-forecast", "seqmoe-prior-eviction"])
@pytest.mark.parametrize("seed,r,bw", CASES[::4])
def test_compiled_equals_reference_on_every_miss_path(name, miss, host_bw, seed, r, bw):
    ref, fast = _both(name, seed, r, bw, miss=miss, host_bw=host_bw)
    assert fast == ref
    assert ref["in_place"] + ref["host"] == ref["misses"] or miss == "auto"


@pytest.mark.parametrize("host_bw", [100e9, 5e9])
def test_auto_takes_every_path_and_both_managers_agree(host_bw):
    """Over all cases, `auto` copies, reads in place and computes on the host (the test above is not vacuous)."""
    seen = {"copies": 0, "in_place": 0, "host": 0, "prefetches": 0}
    for seed, r, bw in CASES:
        ref, fast = _both("seqmoe-markov-forecast", seed, r, bw, miss="auto", host_bw=host_bw)
        assert fast == ref
        for k in seen:
            seen[k] += ref[k]
    assert min(seen.values()) > 0, seen


def test_compiled_equals_reference_with_the_trained_forecaster_on_auto(tiny_forecaster):
    d, train, test = tiny_forecaster
    pred = load_seq_predictor(d / "pred")
    for r, bw, host_bw in ((0.3, 3e9, 100e9), (0.25, 1e9, 5e9), (0.6, 3e10, 5e9)):
        C = capacity_for(r, test.num_layers, test.num_experts, test.top_k)
        start = start_placement(train, C)
        inputs = SystemInputs(train=train, test=test, capacity=C, start=tuple(start), predictor=pred)
        ref, fast = (_counts(test, lambda: build_system("seqmoe", inputs, "auto"), C, start, bw, compiled, host_bw)
                     for compiled in (False, True))
        assert fast == ref
        assert ref["host"] + ref["in_place"] > 0


def test_at_top_k_slots_a_demand_copy_waits_for_a_running_prefetch():
    ref, fast = _both("seqmoe-markov-forecast", 3, 3 / 64, 1e9)
    assert fast == ref


class _Recorder:
    def __init__(self):
        self.calls = []

    def on_load(self, uid, demand, deadline_step):
        self.calls.append(("load", uid, demand, deadline_step))

    def on_promote(self, uid):
        self.calls.append(("promote", uid))

    def on_evict(self, uid):
        self.calls.append(("evict", uid))

    def on_off_pool(self, uid, path):
        self.calls.append(("off-pool", uid, path))


@pytest.mark.parametrize("miss", ["copy", "auto"])
def test_the_observer_hears_the_same_calls_in_the_same_order(miss):
    train = make_trace(num_tokens=300, seed=7, **SHAPE)
    test = make_trace(num_tokens=120, seed=8, **SHAPE)
    C = capacity_for(0.2, 4, 16, 3)
    start = start_placement(train, C)
    calls = []
    for cls in (MemoryManager, CompiledManager):
        rec = _Recorder()
        policy = ForecastPolicy.from_trace(train)  # plans after each layer too: promotions happen then
        pre = DeadlinePrefetcher(policy, margin=0.5, replan_after_compute=True)  # a fixed price: many prefetches
        system = System("markov", policy, AffinityPredictor(train), pre, miss=miss)
        drive(cls(system, model=tiny_model(test), hardware=_hardware(3e8, 5e8), capacity=C, start=start,
                  observer=rec), test)
        calls.append(rec.calls)
    assert calls[0] == calls[1] and len(calls[0]) > 100
    heard = {c[0] for c in calls[0]}
    assert heard == ({"load", "promote", "evict"} if miss == "copy" else {"load", "evict", "off-pool"} | heard)
    assert miss == "copy" or {c[2].name for c in calls[0] if c[0] == "off-pool"} == {"cpu", "in-place"}


def test_build_manager_compiles_what_it_can():
    train = make_trace(num_tokens=100, seed=1)
    C = capacity_for(0.5, train.num_layers, train.num_experts, train.top_k)
    inputs = SystemInputs(train=train, test=train, capacity=C, start=tuple(start_placement(train, C)))
    kinds = {}
    hw = dataclasses.replace(tiny_hardware(), host_memory_bytes_per_s=1e11, host_cores=8)
    for name, spec in SYSTEMS.items():
        if spec.needs_predictor or spec.needs_pregate:
            continue
        system = build_system(name, inputs)
        m = build_manager(system, model=tiny_model(train), hardware=hw, capacity=C, start=inputs.start)
        kinds[name] = type(m).__name__
        ref = build_manager(system, model=tiny_model(train), hardware=hw, capacity=C, start=inputs.start,
                            compiled=False)
        assert isinstance(ref, MemoryManager)
    assert kinds["on-demand-lru"] == kinds["seqmoe-markov-forecast"] == "CompiledManager"
    assert kinds["belady"] == kinds["moe-infinity-style"] == kinds["seqmoe-oracle-forecast"] == "MemoryManager"
    assert kinds["cpu-all"] == "MemoryManager" and kinds["static-split-style"] == "CompiledManager"
    auto = build_system("on-demand-lru", inputs, "auto")
    m = build_manager(auto, model=tiny_model(train), hardware=hw, capacity=C, start=inputs.start)
    assert type(m) is CompiledManager


def test_the_compiled_miss_kinds_follow_the_miss_paths():
    from seqmoe.brain.manager.compiled import layout
    from seqmoe.brain.manager.miss_paths import MISS_PATHS

    kinds = (layout.MISS_COPY, layout.MISS_IN_PLACE, layout.MISS_CPU, layout.MISS_AUTO)
    assert [MISS_PATHS[k] for k in kinds] == ["copy", "in-place", "cpu", "auto"]
    assert layout.PATH_CPU_COPY not in kinds


def test_the_kernel_build_dir_is_keyed_by_every_kernel_module():
    """numba checks a cached function against its own file only: every module holding kernels must
    be hashed into the build folder's name, or an edit of a callee would keep its old code."""
    here = Path(_build_dir.__file__).parent
    jitted = {p.stem for p in here.glob("*.py") if re.search(r"^@jit|nb\.njit", p.read_text(), re.M)}
    assert jitted <= set(_build_dir.MODULES)
    # so must every module outside the package a kernel module imports constants from
    imports = re.compile(r"^from seqmoe\.((?!brain\.manager\.compiled)[\w.]+) import", re.M)
    outside = {m.replace(".", "/") + ".py" for name in _build_dir.MODULES
               for m in imports.findall((here / f"{name}.py").read_text())}
    assert outside == set(_build_dir.CONSTANTS)
    assert _build_dir.build_dir().name != ""

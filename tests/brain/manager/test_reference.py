"""A decision is written once: a policy with no compiled kernels runs on the reference manager and
says so (a warning when its manager is built, `stats()["manager"]`, a replay's row), and every
registered system that can run compiled makes the reference's decisions, count for count.
Run: pytest tests/brain/manager/test_reference.py -q
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch

from seqmoe.brain.manager import (ReferenceManagerWarning, SystemInputs, build_manager, build_system, capacity_for,
                                  manager_kind, start_placement)
from seqmoe.brain.manager.base import System
from seqmoe.brain.manager.compiled import CompiledManager, compilable
from seqmoe.brain.manager.state import MemoryManager
from seqmoe.brain.manager.systems import SYSTEMS, register_system
from seqmoe.brain.policies.base import EvictionPolicy
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.sim import simulate
from tests.conftest import make_trace, tiny_hardware, tiny_model

SHAPE = dict(num_layers=4, num_experts=16, top_k=3)


class FIFOPolicy(EvictionPolicy):
    """Evicts the expert that got its slot first: a policy written only in Python."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def reset(self, resident) -> None:
        self._order = OrderedDict.fromkeys(resident)

    def insert(self, uid: int, step: int) -> None:
        self._order[uid] = None

    def access(self, uid: int, step: int) -> None:
        pass

    def victim(self, incoming: int, pinned) -> int | None:
        return next((u for u in self._order if u not in pinned), None)

    def remove(self, uid: int) -> None:
        self._order.pop(uid, None)


@pytest.fixture
def fifo_system():
    name = "test-fifo"
    register_system(name, "test: first in, first out", learns=False)(lambda inputs: System(name, FIFOPolicy()))
    yield name
    del SYSTEMS[name]


def _replay(system_of, compiled: bool, seed: int = 0, r: float = 0.3):
    train, test = make_trace(num_tokens=300, seed=seed + 50, **SHAPE), make_trace(num_tokens=160, seed=seed, **SHAPE)
    C = capacity_for(r, test.num_layers, test.num_experts, test.top_k)
    start = start_placement(train, C)
    system = system_of(SystemInputs(train=train, test=test, capacity=C, start=tuple(start)))
    counts = simulate(test, system, model=tiny_model(test), hardware=tiny_hardware(3e9), capacity=C, start=start,
                      compiled=compiled)
    return {k: v for k, v in dataclasses.asdict(counts).items() if k != "decision_s"}


def test_a_python_only_policy_runs_on_the_reference_and_says_so(fifo_system):
    train = make_trace(num_tokens=100, seed=1, **SHAPE)
    C = capacity_for(0.3, train.num_layers, train.num_experts, train.top_k)
    system = build_system(fifo_system, SystemInputs(train=train, test=train, capacity=C, start=()))
    assert manager_kind(system) == {"manager": "reference",
                                    "manager_reason": "its eviction policy FIFOPolicy has no compiled kernels "
                                                      "(`compiled_as`)"}
    with pytest.warns(ReferenceManagerWarning, match="'test-fifo' runs on the reference manager"):
        m = build_manager(system, model=tiny_model(train), hardware=tiny_hardware(), capacity=C, start=())
    assert type(m) is MemoryManager
    of = lambda inputs: build_system(fifo_system, inputs)  # noqa: E731
    with pytest.warns(ReferenceManagerWarning):
        asked = _replay(of, compiled=True)
    assert asked == _replay(of, compiled=False) and asked["misses"] > 0


def test_a_subclass_of_a_compiled_policy_is_not_compiled():
    from seqmoe.brain.policies.lru import LRUPolicy

    class Tweaked(LRUPolicy):
        pass

    assert compilable(System("lru", LRUPolicy())) and not compilable(System("tweaked", Tweaked()))


def test_a_python_only_policy_runs_live_and_says_so(fifo_system):
    from seqmoe.runtime import offload
    from tests.runtime.conftest import TEST_HW, fresh, greedy, reference

    ref = reference("mixtral")
    model = fresh("mixtral")
    with pytest.warns(ReferenceManagerWarning, match="'test-fifo'"):
        rt = offload(model, 0.3, fifo_system, hardware=TEST_HW)
    assert torch.equal(greedy(model), ref.tokens)
    stats = rt.stats()
    assert stats["manager"] == "reference" and "FIFOPolicy" in stats["manager_reason"]
    assert stats["misses"] > 0
    rt.restore()


@pytest.mark.parametrize("name", [n for n, s in SYSTEMS.items() if not s.needs_pregate])
def test_every_registered_system_that_compiles_agrees_with_the_reference(name, tiny_forecaster):
    """Generated from the registry: a new system whose parts have kernels is covered here."""
    d, train, test = tiny_forecaster
    pred = load_seq_predictor(d / "pred") if SYSTEMS[name].needs_predictor else None
    C = capacity_for(0.3, test.num_layers, test.num_experts, test.top_k)
    start = start_placement(train, C)
    inputs = SystemInputs(train=train, test=test, capacity=C, start=tuple(start), predictor=pred)
    kind = manager_kind(build_system(name, inputs))
    if kind["manager"] == "reference":
        pytest.skip(f"{name} runs on the reference manager: {kind['manager_reason']}")
    hw = dataclasses.replace(tiny_hardware(3e9), host_memory_bytes_per_s=1e11, host_cores=8)
    runs = [simulate(test, build_system(name, inputs), model=tiny_model(test), hardware=hw, capacity=C, start=start,
                     compiled=compiled) for compiled in (False, True)]
    ref, fast = ({k: v for k, v in dataclasses.asdict(c).items() if k != "decision_s"} for c in runs)
    assert fast == ref
    assert type(build_manager(build_system(name, inputs), model=tiny_model(test), hardware=hw, capacity=C,
                              start=start)) is CompiledManager

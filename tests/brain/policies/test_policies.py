"""Eviction policies against models and against Belady.  Run: pytest tests/cache -q"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from seqmoe.brain.policies import BeladyPolicy, FutureUses, LayerLRUPolicy, LFUPolicy, LRUPolicy, belady_misses, belady_schedule
from tests.conftest import make_trace


def demand_misses(policy, uids: np.ndarray, capacity: int, start) -> int:
    """Sequential demand paging with `policy`, the model the Belady bound is defined on."""
    policy.reset(list(start))
    resident, misses = set(start), 0
    for step, needed in enumerate(uids.reshape(-1, uids.shape[2]).tolist()):
        pinned = set(needed)
        for u in needed:
            if u in resident:
                policy.access(u, step)
        for u in needed:
            if u not in resident:
                misses += 1
                if len(resident) >= capacity:
                    v = policy.victim(u, pinned)
                    policy.remove(v)
                    resident.discard(v)
                resident.add(u)
                policy.insert(u, step)
                policy.access(u, step)
        assert len(resident) <= capacity
    return misses


class LRUMachine(RuleBasedStateMachine):
    """LRUPolicy agrees with an OrderedDict model under any sequence of operations."""

    def __init__(self):
        super().__init__()
        self.policy, self.model = LRUPolicy(), OrderedDict()
        self.policy.reset([])

    @rule(uid=st.integers(0, 15))
    def insert_or_access(self, uid):
        if uid in self.model:
            self.policy.access(uid, 0)
            self.model.move_to_end(uid)
        else:
            self.policy.insert(uid, 0)
            self.model[uid] = None

    @precondition(lambda self: len(self.model) > 0)
    @rule(pinned=st.sets(st.integers(0, 15), max_size=4))
    def evict(self, pinned):
        v = self.policy.victim(-1, pinned)
        expected = next((u for u in self.model if u not in pinned), None)
        assert v == expected
        if v is not None:
            self.policy.remove(v)
            del self.model[v]

    @invariant()
    def same_order(self):
        assert list(self.policy._order) == list(self.model)


TestLRUMachine = LRUMachine.TestCase


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(2, 20))
def test_belady_misses_at_most_any_policy(seed, capacity):
    trace = make_trace(num_tokens=60, num_layers=3, num_experts=8, top_k=2, seed=seed)
    uids = trace.uids()
    start = list(range(0, 24, 3))[:capacity]
    n_opt = belady_misses(uids, capacity, start)
    future = FutureUses(uids, 24)
    for policy in (LRUPolicy(), LFUPolicy(), LayerLRUPolicy(num_layers=3, num_experts=8, capacity=capacity), BeladyPolicy(future)):
        assert n_opt <= demand_misses(policy, uids, capacity, start)
    # The layer-pinned Belady schedule copies exactly what BeladyPolicy demand paging copies.
    assert len(belady_schedule(uids, capacity, start, future)) == demand_misses(BeladyPolicy(future), uids, capacity, start)


def test_belady_misses_hand_example():
    # One layer, one expert per token, 2 slots: accesses 0 1 2 0 1 3 0 from empty -> 5 misses (OPT).
    uids = np.array([0, 1, 2, 0, 1, 3, 0]).reshape(7, 1, 1)
    assert belady_misses(uids, 2, []) == 5


def test_lfu_evicts_least_used_then_least_recent():
    p = LFUPolicy()
    p.reset([])
    for u in (1, 2, 3):
        p.insert(u, 0)
    for u in (1, 1, 2, 3):
        p.access(u, 0)
    assert p.victim(9, set()) == 2  # 2 and 3 used once; 2 less recently
    assert p.victim(9, {2}) == 3


def test_layer_lru_takes_from_the_layer_most_over_quota():
    p = LayerLRUPolicy(num_layers=2, num_experts=4, capacity=4)  # quota 2 per layer
    p.reset([0, 1, 2, 4])  # layer 0 holds 3, layer 1 holds 1
    assert p.victim(5, set()) // 4 == 0  # layer 1 under quota: take from layer 0
    assert p.victim(3, set()) // 4 == 0  # layer 0 over quota: its own LRU

"""Belady's policy (evict the expert whose next use is furthest away) and the Belady miss count.

Both need the future, so they are oracles: upper bounds for policies and the source of the
simulator's `bound_time_s`. `FutureUses` answers "when is uid used next after position s".
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Container, Sequence

import numpy as np

from seqmoe.brain.policies.base import EvictionPolicy, lazy_heap_victim

NEVER = 1 << 62  # next use of an expert that is never used again


class FutureUses:
    """Positions at which each uid is used (`uses[uid]`, increasing).

    Args:
        uids: [T, L, K] int64 global expert ids of the replayed trace.
        num_uids: L * E.
    """

    def __init__(self, uids: np.ndarray, num_uids: int) -> None:
        T, L, K = uids.shape
        steps = np.repeat(np.arange(T * L, dtype=np.int64), K)  # [T*L*K] position of each access
        flat = uids.reshape(-1)
        order = np.lexsort((steps, flat))
        bounds = np.searchsorted(flat[order], np.arange(num_uids + 1))
        sorted_steps = steps[order]
        self.uses = [sorted_steps[bounds[u] : bounds[u + 1]].tolist() for u in range(num_uids)]
        # next_step[i]: the position of the next use of access i's uid after access i.
        nxt = np.full(len(flat), NEVER, dtype=np.int64)
        same = flat[order][1:] == flat[order][:-1]
        nxt[order[:-1][same]] = sorted_steps[1:][same]
        self.next_step = nxt.tolist()

    def next_use(self, uid: int, after_step: int) -> int:
        """First position strictly after `after_step` that uses `uid` (NEVER if none)."""
        uses = self.uses[uid]
        i = bisect_right(uses, after_step)
        return uses[i] if i < len(uses) else NEVER


class BeladyPolicy(EvictionPolicy):
    """Evict the resident expert whose next use is furthest in the future (needs the future).

    Args:
        future: the uses of the replayed trace.
    """

    def __init__(self, future: FutureUses) -> None:
        self._future = future
        self.reset(())

    def reset(self, resident: Sequence[int]) -> None:
        self._next: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []  # (-next use, uid), stale entries skipped
        self._cursor = [0] * len(self._future.uses)  # per uid: index of its first use not yet passed
        for uid in resident:
            self.insert(int(uid), -1)

    def _set_after(self, uid: int, step: int) -> None:
        # Replays move forward, so a per-uid cursor finds the next use in amortised O(1).
        uses, i = self._future.uses[uid], self._cursor[uid]
        while i < len(uses) and uses[i] <= step:
            i += 1
        self._cursor[uid] = i
        nxt = uses[i] if i < len(uses) else NEVER
        self._next[uid] = nxt
        heapq.heappush(self._heap, (-nxt, uid))

    def insert(self, uid: int, step: int) -> None:
        self._set_after(uid, step)

    def access(self, uid: int, step: int) -> None:
        self._set_after(uid, step)

    def next_use(self, uid: int) -> int:
        """The tracked next use of resident `uid`."""
        return self._next[uid]

    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        return lazy_heap_victim(self._heap, lambda e: self._next.get(e[1]) == -e[0], pinned)

    def remove(self, uid: int) -> None:
        del self._next[uid]


def belady_misses(uids: np.ndarray, capacity: int, start: Sequence[int], future: FutureUses | None = None) -> int:
    """Demand misses of Belady's policy with `capacity` slots from placement `start`.

    Accesses are served one at a time in execution order (token, layer, slot). No system that holds
    at most `capacity` experts can copy fewer experts than this (Belady, 1966), prefetching or not.

    Args:
        uids: [T, L, K] int64 global expert ids.
        capacity: C, number of slots.
        start: the start placement (at most C uids).
        future: precomputed `FutureUses(uids, ...)`, if at hand.

    Returns:
        The number of misses.
    """
    flat = uids.reshape(-1).tolist()
    if future is None:
        future = FutureUses(uids, max(int(uids.max()), max(start, default=-1)) + 1)
    nxt = future.next_step
    next_of = {int(u): future.next_use(int(u), -1) for u in start}
    heap = [(-n, u) for u, n in next_of.items()]
    heapq.heapify(heap)
    misses = 0
    for i, uid in enumerate(flat):
        if uid not in next_of:
            misses += 1
            if len(next_of) >= capacity:
                while True:
                    neg, v = heapq.heappop(heap)
                    if next_of.get(v) == -neg:
                        break
                del next_of[v]
        n = nxt[i]
        next_of[uid] = n
        heapq.heappush(heap, (-n, uid))
    return misses


def belady_schedule(uids: np.ndarray, capacity: int, start: Sequence[int], future: FutureUses | None = None) -> list[tuple[int, int, int, int]]:
    """The copies of Belady demand paging when a layer's K experts must be resident together.

    Args:
        uids: [T, L, K] int64 global expert ids.
        capacity: C, slots (at least K).
        start: the start placement.
        future: precomputed `FutureUses`, if at hand.

    Returns:
        One (step, uid, victim, victim_last_use) per copy in execution order: the expert loaded for
        position `step`, the expert it replaces (-1 while slots are free) and the last position
        that used the victim before (-1 if none).
    """
    T, L, K = uids.shape
    if future is None:
        future = FutureUses(uids, max(int(uids.max()), max(start, default=-1)) + 1)
    policy = BeladyPolicy(future)
    policy.reset(list(start))
    resident, last_use = set(int(u) for u in start), {}
    out = []
    flat = uids.reshape(T * L, K).tolist()
    for step, needed in enumerate(flat):
        pinned = set(needed)
        for uid in needed:
            if uid in resident:
                policy.access(uid, step)
        for uid in needed:
            if uid in resident:
                continue
            victim = -1
            if len(resident) >= capacity:
                victim = policy.victim(uid, pinned)
                policy.remove(victim)
                resident.discard(victim)
            out.append((step, uid, victim, last_use.get(victim, -1)))
            resident.add(uid)
            policy.insert(uid, step)
        for uid in needed:
            last_use[uid] = step
    return out

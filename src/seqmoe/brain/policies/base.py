"""Eviction policies: which resident expert leaves when a slot is needed.

The simulator (and the runtime) own the slot table: which uids are resident and which copies are
pending. A policy only ranks. It hears about every use, load and eviction and, when asked, names a
victim among the resident uids that are not pinned (needed by the current layer or still copying).

    policy.reset(resident)        # start placement, most valuable first
    policy.insert(uid, step)      # uid got a slot (demand load or prefetch issued)
    policy.access(uid, step)      # uid was used at position `step`
    policy.victim(incoming, pinned) -> uid | None
    policy.remove(uid)            # uid lost its slot

Positions (`step`) count (token, layer) pairs in execution order: `step = t * L + layer_id`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Sequence
from typing import Protocol


class EvictionPolicy(Protocol):
    def reset(self, resident: Sequence[int]) -> None:
        """Forget everything; `resident` is the start placement, most valuable first."""

    def insert(self, uid: int, step: int) -> None:
        """`uid` was given a slot at position `step`."""

    def access(self, uid: int, step: int) -> None:
        """`uid` was used at position `step` (it is resident)."""

    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        """The resident uid to evict to make room for `incoming`; None when all are pinned."""

    def remove(self, uid: int) -> None:
        """`uid` left the pool."""



def lazy_heap_victim(heap: list[tuple], is_live: Callable[[tuple], bool], pinned: Container[int]) -> int | None:
    """The uid of the smallest live, unpinned entry of a heap that holds stale entries.

    Policies keep one heap entry per update and skip outdated ones when popping (cheaper than
    re-keying). Entries end with the uid; stale entries are dropped, pinned ones put back.
    """
    skipped, found = [], None
    while heap:
        entry = heap[0]
        if not is_live(entry):
            heapq.heappop(heap)
        elif entry[-1] in pinned:
            skipped.append(heapq.heappop(heap))
        else:
            found = entry[-1]
            break
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found

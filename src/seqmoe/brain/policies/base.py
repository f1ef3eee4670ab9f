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
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Sequence
from typing import ClassVar

import numpy as np


class EvictionPolicy(ABC):
    """What a policy must do (the abstract methods) and every hook it may implement (no-ops here).

    A policy runs at compiled speed when its exact class names its kernels (`compiled_as`); any other
    runs on the reference manager, which `seqmoe.brain.manager.build_manager` reports."""

    compiled_as: ClassVar[str | None] = None
    """The compiled manager's kernels for this exact class (`seqmoe.brain.manager.compiled.manager.
    COMPILED_POLICIES`); None: the reference manager runs it. A subclass must name its own: the
    kernels do not know its overrides."""

    @abstractmethod
    def reset(self, resident: Sequence[int]) -> None:
        """Forget everything; `resident` is the start placement, most valuable first."""

    @abstractmethod
    def insert(self, uid: int, step: int) -> None:
        """`uid` was given a slot at position `step`."""

    @abstractmethod
    def access(self, uid: int, step: int) -> None:
        """`uid` was used at position `step` (it is resident)."""

    @abstractmethod
    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        """The resident uid to evict to make room for `incoming`; None when all are pinned."""

    @abstractmethod
    def remove(self, uid: int) -> None:
        """`uid` left the pool."""

    def note_use(self, uid: int, step: int) -> None:
        """`uid` was used at position `step` without a slot (read in place, computed on the host CPU,
        or its twin read): a policy that values experts by their uses hears of it."""

    def keep_value(self, uids: Sequence[int]) -> np.ndarray | None:
        """[len(uids)] the value of keeping each uid resident (a miss path copies an expert only when it
        is worth its victim's slot); None: the policy values nothing, and every expert is worth a slot."""
        return None

    def set_prior(self, use_rate: np.ndarray, reuse) -> None:
        """A forecaster learned online refitted its prior beyond the forecast: `use_rate` [L * E] uses
        per token, `reuse` a `ReuseTable` or None."""

    def set_far(self, far: np.ndarray) -> None:
        """The forecaster's long-range head: [L * E] probability of a use within its far horizon."""


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

"""Recency and frequency policies: global LRU, global LFU, and LRU split into per-layer groups."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Sequence

from seqmoe.brain.policies.base import EvictionPolicy, lazy_heap_victim


class LRUPolicy(EvictionPolicy):
    """Evict the least recently used expert of the whole pool."""

    compiled_as = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def reset(self, resident: Sequence[int]) -> None:
        # Most valuable first in, so it counts as most recent: insert in reverse.
        self._order = OrderedDict((int(u), None) for u in reversed(resident))

    def insert(self, uid: int, step: int) -> None:
        self._order[uid] = None
        self._order.move_to_end(uid)

    def access(self, uid: int, step: int) -> None:
        self._order.move_to_end(uid)

    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        for uid in self._order:
            if uid not in pinned:
                return uid
        return None

    def remove(self, uid: int) -> None:
        del self._order[uid]


class LFUPolicy(EvictionPolicy):
    """Evict the least frequently used expert (uses counted since reset); ties by least recent use."""

    def __init__(self) -> None:
        self.reset(())

    def reset(self, resident: Sequence[int]) -> None:
        self._count: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []  # (count, last use, uid); stale entries skipped
        self._tick = 0
        for uid in reversed(resident):
            self.insert(int(uid), -1)

    def _push(self, uid: int) -> None:
        self._tick += 1
        self._last[uid] = self._tick
        heapq.heappush(self._heap, (self._count[uid], self._tick, uid))

    def insert(self, uid: int, step: int) -> None:
        self._count.setdefault(uid, 0)
        self._push(uid)

    def access(self, uid: int, step: int) -> None:
        self._count[uid] += 1
        self._push(uid)

    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        return lazy_heap_victim(self._heap, lambda e: self._last.get(e[2]) == e[1], pinned)

    def remove(self, uid: int) -> None:
        # Counts are kept (LFU with memory); the heap entry goes stale.
        del self._last[uid]


class LayerLRUPolicy(EvictionPolicy):
    """LRU within per-layer groups of equal quota (mixtral-offloading-style).

    mixtral-offloading keeps a fixed number of expert slots per layer with LRU inside each layer.
    All systems start from the same global placement, which is uneven across layers, so quotas
    (`capacity // L`, the remainder to the first layers) are reached lazily: a layer at or over its
    quota evicts its own least recent expert; a layer under quota takes a slot from the layer most
    over its quota.
    """

    def __init__(self, *, num_layers: int, num_experts: int, capacity: int) -> None:
        self._E = num_experts
        base, extra = divmod(capacity, num_layers)
        self._quota = [base + (1 if l < extra else 0) for l in range(num_layers)]
        self._groups = [OrderedDict() for _ in range(num_layers)]

    def reset(self, resident: Sequence[int]) -> None:
        for g in self._groups:
            g.clear()
        for uid in reversed(resident):
            self._groups[int(uid) // self._E][int(uid)] = None

    def insert(self, uid: int, step: int) -> None:
        self._groups[uid // self._E][uid] = None

    def access(self, uid: int, step: int) -> None:
        self._groups[uid // self._E].move_to_end(uid)

    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        layer = incoming // self._E
        order = [layer] if len(self._groups[layer]) >= self._quota[layer] else []
        # Then the layers most over their quota.
        order += sorted(range(len(self._groups)), key=lambda l: self._quota[l] - len(self._groups[l]))
        for l in order:
            for uid in self._groups[l]:
                if uid not in pinned:
                    return uid
        return None

    def remove(self, uid: int) -> None:
        del self._groups[uid // self._E][uid]

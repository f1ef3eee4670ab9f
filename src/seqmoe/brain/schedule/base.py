"""Prefetch schedulers: turn a forecast into copies on the one transfer channel.

A scheduler sees the pool through a `PoolView` and issues copies with `view.prefetch`, which
reserves a slot at once (evicting the eviction policy's victim) and queues the copy behind
earlier ones, earliest deadline first. The simulator and the runtime provide the view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import numpy as np

from seqmoe.brain.predict.base import Forecast


class PoolView(Protocol):
    step: int
    """The current position (its routing is known)."""
    now: float
    """Current time, seconds."""
    capacity: int
    """C, slots in the pool."""
    copy_time_s: float
    """Seconds per expert copy."""
    channel_use: float
    """Share of time the copy channel has been busy lately (a moving average over tokens)."""
    num_experts: int
    """E."""
    num_layers: int
    """L."""

    def present(self, uid: int) -> bool:
        """Resident or its copy already issued."""

    def present_mask(self) -> np.ndarray:
        """[L * E] uint8, 1 where `present(uid)`; a read-only view, valid until the next prefetch."""

    def eta(self, step):
        """Estimated time at which the layer at `step` starts its experts, at the measured pace; works on arrays."""

    def backlog_end(self) -> float:
        """When the channel would be idle if nothing more were issued."""

    def victim(self, incoming: int) -> int | None:
        """Who the eviction policy would evict for `incoming` now; None when the pool is pinned full."""

    def prefetch(self, uid: int, deadline_step: int, victim: int | None = None) -> bool:
        """Reserve a slot for `uid` and queue its copy; False if no slot can be freed.

        When the pool is full, `victim` (if given, it must be resident and unpinned) or else the
        eviction policy's choice is evicted.
        """

    def cancel(self, uid: int) -> bool:
        """Drop the queued prefetch of `uid` before its copy starts and free its slot (its victim
        stays evicted); False if the copy has started or `uid` is not a queued prefetch."""


class Prefetcher(ABC):
    """Called at the start of each token and after each layer's routing is revealed."""

    replan_after_compute: bool = False
    """Also called after each layer's expert computation, when that layer's experts stop being pinned."""

    @abstractmethod
    def plan(self, forecast: Forecast | None, view: PoolView) -> None:
        """Issue the prefetches worth issuing now through `view.prefetch` (forecast None: no predictor)."""

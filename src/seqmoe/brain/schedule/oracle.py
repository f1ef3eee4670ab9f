"""oracle-prefetch: perfect knowledge of the future, Belady eviction, each copy as early as its slot allows.

The copies are exactly those of Belady demand paging (with a layer's K experts resident together),
which no system with C slots can undercut by much (Belady, 1966). Each copy is issued as soon as
the expert it replaces has had its last use before the copy's own use ("conservative" integrated
prefetching, Cao et al., SIGMETRICS 1995), so the copies keep Belady's count and start as early as
the slots allow. This is the ceiling any predictor can reach under the same channel and slots.
"""

from __future__ import annotations

from seqmoe.brain.predict.base import Forecast
from seqmoe.brain.schedule.base import PoolView, Prefetcher


class OraclePrefetcher(Prefetcher):
    """Issue the precomputed Belady copies as early as their victims allow (needs the future).

    Copies are considered in order within a window of the next `window` planned copies; one whose
    victim is still needed waits, and the copies behind it may go first (the channel runs queued
    copies earliest deadline first anyway).

    Args:
        schedule: `seqmoe.brain.policies.belady.belady_schedule(...)` of the replayed trace.
        window: how many planned copies ahead of the first unissued one may be issued.
    """

    replan_after_compute = True  # a victim frees when its last layer finishes computing

    def __init__(self, schedule: list[tuple[int, int, int, int]], window: int = 48) -> None:
        self._schedule = schedule
        self._window = window
        self._next = 0  # first copy not yet issued
        self._issued: set[int] = set()  # issued copies at or after _next

    def plan(self, forecast: Forecast | None, view: PoolView) -> None:
        sched, issued = self._schedule, self._issued
        waiting_for: set[int] = set()  # experts of unissued copies: later victims among them must wait
        for j in range(self._next, min(self._next + self._window, len(sched))):
            if j in issued:
                continue
            step, uid, victim, victim_last_use = sched[j]
            if step <= view.step:  # its layer has revealed; the replay fetched it on demand
                issued.add(j)
                continue
            if victim_last_use > view.step or victim in waiting_for or not view.prefetch(
                uid, step, victim=victim if victim >= 0 else None
            ):
                waiting_for.add(uid)
                continue
            issued.add(j)
        while self._next in issued:
            issued.discard(self._next)
            self._next += 1

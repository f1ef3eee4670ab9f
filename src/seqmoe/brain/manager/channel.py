"""The copy channel: one host-to-device channel, copies one at a time.

Rules (docs/DESIGN.md): a demand copy goes ahead of queued prefetches but does not interrupt the running
copy; queued prefetches run earliest deadline first. The channel is advanced lazily: the caller
moves time forward with `advance(t)` before issuing anything at time t, so every queued copy was
issued while the channel was busy.

An in-place read (a miss served from the host row, no slot taken) holds the channel like a copy:
it is queued as a demand under the key `in_place_key(uid)` (negative) and counted in `reads`. A
twin read (`seqmoe.brain.manager.miss_paths.Twin`) is the same under `twin_key(uid, n)`, below the
in-place keys, and holds the channel for `twin_time_s`.
"""

from __future__ import annotations

import heapq
from collections import deque


class CopyChannel:
    """One copy channel.

    Args:
        copy_time_s: seconds per expert copy (`alpha + bytes / bandwidth`).
        num_uids: L * E (twin reads are the keys below -num_uids).
        twin_time_s: seconds per twin read (None: no twins).
    """

    def __init__(self, copy_time_s: float, num_uids: int = 0, twin_time_s: float | None = None) -> None:
        self.copy_time_s = copy_time_s
        self.twin_time_s = twin_time_s
        self._twin_below = -num_uids if twin_time_s is not None else -(1 << 62)
        self.free_at = 0.0  # when the running copy ends (<= now when idle)
        self.started = 0  # copies started so far
        self.reads = 0  # in-place and twin reads started so far
        self.twin_reads = 0  # of which twin reads
        self._demand: deque[tuple[int, int]] = deque()  # (seq, uid)
        self._prefetch: list[tuple[int, int, int]] = []  # (deadline step, seq, uid)
        self._queued: dict[int, int] = {}  # uid -> seq of its live queue entry; other entries are stale
        self._seq = 0
        self._running: deque[tuple[float, int]] = deque()  # (done time, uid), in completion order
        self.done_at: dict[int, float] = {}  # uid -> completion time, for started copies not yet finished

    def _start_next(self, at: float) -> bool:
        while self._demand or self._prefetch:
            seq, uid = self._demand.popleft() if self._demand else heapq.heappop(self._prefetch)[1:]
            if self._queued.get(uid) != seq:  # promoted or cancelled entry
                continue
            del self._queued[uid]
            self.free_at = at + self.duration(uid)
            self.done_at[uid] = self.free_at
            self._running.append((self.free_at, uid))
            if uid < 0:
                self.reads += 1
                self.twin_reads += uid < self._twin_below
            else:
                self.started += 1
            return True
        return False

    def duration(self, key: int) -> float:
        """Seconds the transfer under `key` holds the channel (a twin read's, else a copy's)."""
        return self.twin_time_s if key < self._twin_below else self.copy_time_s

    def advance(self, t: float) -> list[int]:
        """Run the channel up to time t; returns the uids whose copies finished by t."""
        while self.free_at < t and self._queued and self._start_next(self.free_at):
            pass
        finished = []
        while self._running and self._running[0][0] <= t:
            _, uid = self._running.popleft()
            del self.done_at[uid]
            finished.append(uid)
        return finished

    def _kick(self, now: float) -> None:
        if self.free_at <= now:
            self._start_next(now)

    def demand(self, uid: int, now: float) -> None:
        """Queue a demand copy at time `now` (ahead of prefetches, behind earlier demands)."""
        self._seq += 1
        self._queued[uid] = self._seq
        self._demand.append((self._seq, uid))
        self._kick(now)

    def prefetch(self, uid: int, deadline_step: int, now: float) -> None:
        """Queue a prefetch at time `now`; prefetches start earliest `deadline_step` first."""
        self._seq += 1
        self._queued[uid] = self._seq
        heapq.heappush(self._prefetch, (deadline_step, self._seq, uid))
        self._kick(now)

    def promote(self, uid: int, now: float) -> None:
        """A queued prefetch is needed now: move it to the demand queue."""
        self.demand(uid, now)  # the old prefetch entry goes stale

    def cancel(self, uid: int) -> bool:
        """Drop a queued (not started) copy; False if it already started or was never queued."""
        if uid in self._queued:
            del self._queued[uid]
            return True
        return False

    def cancel_latest_prefetch(self, keep) -> int | None:
        """Cancel the queued prefetch with the latest deadline whose uid is not in `keep`; its uid or None."""
        live = [(d, seq, uid) for d, seq, uid in self._prefetch if self._queued.get(uid) == seq and uid not in keep]
        if not live:
            return None
        uid = max(live)[2]
        del self._queued[uid]
        return uid

    def running_until(self) -> float | None:
        """When the copy in progress ends, or None when none runs."""
        return self._running[-1][0] if self._running else None

    def demand_finish_times(self) -> dict[int, float]:
        """Completion time of each queued demand copy, in queue order, behind the running copy."""
        t, out = self.free_at, {}
        for seq, uid in self._demand:
            if self._queued.get(uid) == seq:
                t += self.duration(uid)
                out[uid] = t
        return out

    def next_demand_end(self, now: float, twin: bool = False) -> float:
        """When a demand copy (a twin read when `twin`) queued now would finish: behind the running
        copy and the queued demands."""
        live = [uid for seq, uid in self._demand if self._queued.get(uid) == seq]
        if twin:
            return max(self.free_at, now) + self._span(live) + self.twin_time_s
        return max(self.free_at, now) + self._span(live, 1)

    def backlog_end(self, now: float) -> float:
        """When the channel would be idle if nothing more were issued."""
        return max(self.free_at, now) + self._span(self._queued)

    def _span(self, keys, copies: int = 0) -> float:
        """Seconds of the transfers under `keys` and `copies` more copies (counted, then priced: the
        compiled channel's arithmetic)."""
        twins = sum(1 for k in keys if k < self._twin_below) if self.twin_time_s is not None else 0
        span = (len(keys) - twins + copies) * self.copy_time_s
        return span + twins * self.twin_time_s if twins else span

    @property
    def pending(self) -> int:
        """Copies queued or running."""
        return len(self._queued) + len(self._running)


def in_place_key(uid: int) -> int:
    """The channel key of an in-place read of `uid` (apart from a copy of the same uid)."""
    return -1 - uid


def twin_key(uid: int, num_uids: int) -> int:
    """The channel key of a twin read of `uid` (below every in-place key; `num_uids`: L * E)."""
    return -1 - num_uids - uid


class HostLane:
    """The host CPU computing missed experts, one after another (each a pass over its weights at the
    host's full memory bandwidth, so running two at once would not finish either sooner).

    Args:
        expert_s: seconds per expert (`seqmoe.costs.host_cost.host_expert_time_s`).
    """

    def __init__(self, expert_s: float) -> None:
        self.expert_s = expert_s
        self.free_at = 0.0

    def next_end(self, now: float) -> float:
        """When an expert handed over now would be done."""
        return max(self.free_at, now) + self.expert_s

    def run(self, now: float) -> float:
        """Hand one expert over at `now`; when its output is back."""
        self.free_at = self.next_end(now)
        return self.free_at

"""The copy worker: one thread that moves experts host -> device slot in the simulator's order.

The control plane queues a copy when the state machine issues it (`seqmoe.brain.manager` -> observer ->
`submit`). Like the simulator's `CopyChannel`, the worker runs one copy at a time, demand copies
first in issue order, then prefetches earliest deadline first; a promoted prefetch is queued again
as a demand copy. A copy whose slot changed hands before it ran is skipped. With the pool's
emulated link (`ExpertPool.link_s`) the worker also sleeps that long per copy.
Where copies sit in a decode step: docs/decode.md.
"""

from __future__ import annotations

import heapq
import threading
import time

import torch

from seqmoe.runtime.core.pool import ExpertPool


class CopyWorker:
    """Background copies into `pool`.

    Args:
        pool: the slots to fill.
    """

    def __init__(self, pool: ExpertPool) -> None:
        self.pool = pool
        self._queue: list[tuple[int, int, int, int, int, int]] = []  # (class, key, seq, uid, slot, gen)
        self._seq = 0
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self.copies = 0  # copies published
        self.skipped = 0  # copies dropped because the slot changed hands
        self._link_free = 0.0  # when the emulated link's last copy ends (perf_counter seconds)
        self._thread = threading.Thread(target=self._run, name="seqmoe-copy", daemon=True)
        self._stream = None
        if pool.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=pool.device)
        self._thread.start()

    def submit(self, uid: int, slot: int, gen: int, demand: bool, deadline_step: int) -> None:
        """Queue the copy of `uid` into `slot` (generation `gen`)."""
        self._check()
        with self._cv:
            self._seq += 1
            key = self._seq if demand else deadline_step
            heapq.heappush(self._queue, (0 if demand else 1, key, self._seq, uid, slot, gen))
            self._cv.notify()

    def _run(self) -> None:
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else None
        if ctx is not None:
            ctx.__enter__()
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait()
                if self._stop:
                    self._busy = False
                    self._cv.notify_all()
                    return
                item = self._next_ready()
                if item is None:  # every queued copy waits for its row's disk read: look again shortly
                    self._cv.wait(0.002)
                    continue
                _, _, _, uid, slot, gen = item
                self._busy = True
            try:
                if not self.pool.wanted(uid, slot, gen):
                    self.skipped += 1
                    self._copied(uid)
                    continue
                if self.pool.link_s:
                    self._emulate_link()
                if self.pool.fill(uid, slot, gen, stop=lambda: self._stop):
                    self.copies += 1
                else:
                    self.skipped += 1
                self._copied(uid)
            except BaseException as e:  # surfaced on the model thread by the next call (`pool.fail`)
                self.pool.fail(e)
                with self._cv:
                    self._stop = True
                    self._busy = False
                    self._cv.notify_all()
                return

    def _copied(self, uid: int) -> None:
        """The queued copy of `uid` ran or was dropped: a disk tier's row may go now."""
        if self.pool.cache is not None:
            self.pool.cache.copied(uid)

    def _next_ready(self):
        """The first queued copy in order whose row can be copied now (lock held): with a disk tier,
        copies whose rows are still being read from disk are passed over (a transfer starts when
        its row is in host memory), so one slow read does not hold up the copies behind it."""
        cache = self.pool.cache
        if cache is None:
            return heapq.heappop(self._queue)
        passed, found = [], None
        while self._queue:
            item = heapq.heappop(self._queue)
            if not cache.reading(item[3]):
                found = item
                break
            passed.append(item)
        for item in passed:
            heapq.heappush(self._queue, item)
        return found

    def _emulate_link(self) -> None:
        """Hold the emulated link for one copy. Each copy ends one copy time after the later of now
        and the previous copy's end, so a late wake-up (sleep overshoots by ~0.1 ms here) delays
        that copy but does not slow the link's throughput."""
        now = time.perf_counter()
        self._link_free = max(now, self._link_free) + self.pool.link_s
        time.sleep(self._link_free - now)

    def _check(self) -> None:
        self.pool.raise_failure()

    @property
    def pending(self) -> int:
        """Copies queued (some may turn out stale)."""
        return len(self._queue)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every queued copy has run or been skipped."""
        with self._cv:
            self._cv.wait_for(lambda: (not self._queue and not self._busy) or self._stop, timeout)
        self._check()

    def close(self) -> None:
        """Stop the thread (queued copies are dropped)."""
        with self._cv:
            self._stop = True
            self._queue.clear()
            self._cv.notify_all()
        if self.pool.cache is not None:
            self.pool.cache.wake()  # a copy waiting for a free host row sees the stop
        self._thread.join()

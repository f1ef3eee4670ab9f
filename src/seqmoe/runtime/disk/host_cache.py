"""The runtime's host cache: H expert rows in host memory in front of the checkpoint on disk.

    cache = HostCache(files, tier, numel=P, dtype=torch.bfloat16, pin=False)
    with cache.hold(uid) as row:        # [P] host row, read from disk first if absent; pinned while held
        dst.copy_(row)
    r = cache.pin(uid); ...; cache.unpin(r)   # the same, held across calls (a posted step reads cache.buf[r])
    cache.prefetch(uid)                 # start reading uid's row (no wait)
    layer = cache.layer(l)              # [E, P]-like: layer[e] / layer[a:b] are copies (`DiskLayer`)

`tier` (`seqmoe.brain.manager.host_tier.HostTier`) decides which uid each row holds, here as in the simulator;
this object executes its decisions: a row newly given to a uid is read by a reader thread
(`files.read_into`: large aligned reads that bypass the page cache). Every call into the tier is
made under one lock with the rows that must not change (held, or being read) marked busy, so a
row is never overwritten while it is read or used. A read that fails (a file missing, truncated or
changed since loading) raises its `UserError` in the thread that waits for the row, and the row is
dropped: nothing is computed from a partial row. A quantized store (`store`, a `QuantLayout` over the
checkpoint's layout) quantizes each row as it is read, so the cache holds the store's bytes.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from seqmoe.brain.manager.host_tier import NoFreeRow, Stopped
from seqmoe.base.errors import UserError

READERS = 4
"""Reader threads: enough requests in flight to keep an NVMe drive busy (its queue depth)."""


class HostCache:
    """Rows of a host cache filled from `files` as `tier` decides.

    Args:
        files: the checkpoint's expert tensors (`seqmoe.runtime.disk.checkpoint.ExpertFiles`: `read_into`,
            `expert_nbytes`).
        tier: the host tier deciding (its `rows` sets H).
        numel, dtype: P and the dtype of one packed row.
        pin: page-locked rows (a CUDA device copies from them).
        store: the rows' layout when it is not the checkpoint's: a `QuantLayout` whose base is
            `files.layout`, each row quantized as it is read (numel, dtype: the store's).
    """

    def __init__(self, files, tier, numel: int, dtype: torch.dtype, *, pin: bool = False, readers: int = READERS,
                 store=None) -> None:
        self.files, self.tier, self.store = files, tier, store
        self.num_experts = tier.num_experts
        self.buf = torch.empty((tier.rows, numel), dtype=dtype, pin_memory=pin)
        self._scratch = threading.local()  # a reader's row of the checkpoint's layout, for a quantized store
        self.content = np.full(tier.rows, -1, dtype=np.int64)  # the uid whose bytes a row holds (or is reading)
        self.refs = np.zeros(tier.rows, dtype=np.int64)
        self._reading: dict[int, Future] = {}  # row -> its read
        self._ordered: dict[int, int] = {}  # uid -> copies of it queued and not yet run
        self._lock = threading.Condition(threading.Lock())  # notified when a row stops being busy
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="seqmoe-disk")
        self.reads = self.read_bytes = 0
        self.closed = False

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def _busy(self) -> np.ndarray:
        """[H] rows that must not change now: held or being read; also, while other rows are free
        to go, rows whose copies are queued (evicting those would read them again)."""
        busy = self.refs > 0
        busy[list(self._reading)] = True
        if self._ordered:
            queued = np.isin(self.content, np.fromiter(self._ordered, dtype=np.int64, count=len(self._ordered)))
            if not (busy | queued).all():
                busy |= queued
        return busy

    def _place(self, uid: int, count: bool, wait: bool = True, stop=None) -> int:
        """`uid`'s row, read started if it was not there (lock held). `count`: a need the tier has
        not heard of (a consumer finding its row evicted, or a prefetch), told to it now. When every
        row is busy: wait for one (`wait`), else -1 (a prefetch is only advice); `Stopped` once
        `stop()` is true (a copy worker closing: no row may ever free again)."""
        if self.closed:
            raise UserError("this model's runtime was closed, and its experts stream from disk no more: load it again")
        while self.tier.row_of[uid] < 0 or count:
            try:
                self.tier.need(uid, busy=self._busy())
                break
            except NoFreeRow:
                if not wait:
                    return -1
                if stop is not None and stop():
                    raise Stopped(f"no host row for expert {uid}: the waiter stopped")
                self._lock.wait()  # a read ends, a hold is released, or `wake` (a waiter stops)
        row = int(self.tier.row_of[uid])
        if self.content[row] != uid:
            self.content[row] = uid
            self._reading[row] = self._readers.submit(self._read, uid, row)
        return row

    def _read(self, uid: int, row: int) -> None:
        layer, e = divmod(uid, self.num_experts)
        if self.store is None:
            self.files.read_into(layer, e, self.buf[row])
        else:
            raw = getattr(self._scratch, "row", None)
            if raw is None:
                base = self.files.layout
                raw = self._scratch.row = torch.empty(base.numel, dtype=base.dtype)
            self.files.read_into(layer, e, raw)
            self.store.pack_rows(raw[None], self.buf[row:row + 1])
        n = self.files.expert_nbytes(layer, e)
        with self._lock:  # taken after `_place` recorded this read, so the entry is there to remove
            self.reads += 1
            self.read_bytes += n
            self._reading.pop(row, None)
            self._lock.notify_all()

    def _settle(self, row: int, fut: Future, uid: int) -> None:
        """Wait for the read of `row`; on failure the row is dropped (the tier forgets it) and its
        error raised here, in the thread that needed it. A failed read stays recorded until then."""
        try:
            fut.result()
        except BaseException:
            with self._lock:
                if self._reading.get(row) is fut:
                    del self._reading[row]
                    self.content[row] = -1
                    self.tier.drop(uid)
                    self._lock.notify_all()
            raise

    @contextmanager
    def hold(self, uid: int, stop=None):
        """`uid`'s [P] row in host memory, not changed until the block ends (read first if absent;
        `Stopped` if it must wait for a row and `stop()` turns true, see `wake`)."""
        row = self.pin(uid, stop)
        try:
            yield self.buf[row]
        finally:
            self.unpin(row)

    def pin(self, uid: int, stop=None) -> int:
        """`hold` without a block: `uid`'s row number (read first if absent), not changed until `unpin(row)`."""
        with self._lock:
            row = self._place(uid, count=False, stop=stop)
            self.refs[row] += 1
            fut = self._reading.get(row)
        if fut is not None:
            try:
                self._settle(row, fut, uid)
            except BaseException:
                self.unpin(row)
                raise
        return row

    def wake(self) -> None:
        """Wake every wait for a free row, so a waiter whose `stop()` is now true leaves it."""
        with self._lock:
            self._lock.notify_all()

    def unpin(self, row: int) -> None:
        with self._lock:
            self.refs[row] -= 1
            self._lock.notify_all()

    def prefetch(self, uid: int, copy: bool = False) -> None:
        """The manager needs `uid`'s row soon (a copy, an in-place read or a host-CPU expert was
        ordered): the tier hears of it, and its read starts if the row is absent. `copy`: a copy
        was queued (the row stays while it can until `copied`)."""
        with self._lock:
            if copy:
                self._ordered[uid] = self._ordered.get(uid, 0) + 1
            self._place(uid, count=True, wait=False)

    def copied(self, uid: int) -> None:
        """A queued copy of `uid` ran or was dropped."""
        with self._lock:
            n = self._ordered.get(uid, 0) - 1
            if n > 0:
                self._ordered[uid] = n
            else:
                self._ordered.pop(uid, None)
                self._lock.notify_all()

    def reading(self, uid: int) -> bool:
        """`uid`'s row is being read from disk now (a racy look, without the lock: a hint)."""
        row = int(self.tier.row_of[uid])
        return row >= 0 and self.content[row] == uid and row in self._reading

    def copy_row(self, uid: int) -> torch.Tensor:
        """A copy of `uid`'s row (its own memory: valid after the row changes hands)."""
        with self.hold(uid) as row:
            return row.clone()

    def stats(self, tokens: int) -> dict:
        """The disk tier's counts (`runtime.stats()`): rows, reads and bytes read, the tier's hits."""
        t = self.tier
        needs = t.hits + t.reads
        return {"host_rows": t.rows, "host_policy": t.policy, "disk_reads": self.reads, "disk_bytes": self.read_bytes,
                "disk_bytes_per_token": self.read_bytes / tokens if tokens else 0.0,
                "host_hit_rate": t.hits / needs if needs else 0.0}

    def layer(self, layer: int) -> DiskLayer:
        return DiskLayer(self, layer)

    def close(self) -> None:
        """Stop reading (reads under way finish) and close the checkpoint's files; idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._readers.shutdown(wait=True, cancel_futures=True)
        self.files.close()


class DiskLayer:
    """One MoE layer's experts as the runtime's [E, P] host block reads them: `layer[e]` and
    `layer[a:b]` are copies of rows held in the cache (the host block's users take rows that way)."""

    def __init__(self, cache: HostCache, layer: int) -> None:
        self.cache, self.index = cache, layer
        self.shape = (cache.num_experts, cache.buf.shape[1])
        self.dtype = cache.buf.dtype

    def __getitem__(self, key) -> torch.Tensor:
        base = self.index * self.cache.num_experts
        if isinstance(key, slice):
            return torch.stack([self.cache.copy_row(base + e) for e in range(*key.indices(self.shape[0]))])
        return self.cache.copy_row(base + int(key))

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def element_size(self) -> int:
        return self.cache.buf.element_size()

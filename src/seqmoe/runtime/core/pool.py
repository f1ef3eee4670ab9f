"""The data plane's memory: packed host experts, one static device pool of C slots, the slot table.

    pool = ExpertPool(hosts, capacity=C, device=torch.device("cpu"))
    slot = pool.assign(uid)            # control plane: uid got a slot (its copy is queued)
    pool.release(uid)                  # control plane: uid lost its slot
    pool.fill(uid, slot, gen)          # copy worker: host block -> slot, then publish in the table
    rows = pool.rows(layer, [3, 5])    # experts forward: [2, P], slot when resident, else host

`hosts[l]` [E, P] holds layer l's experts, one contiguous row each (pinned when the device is
CUDA); it is the only copy of the routed weights. The pool [C, P] and the slot table [L, E] int32
(slot or -1) live on the device. A table entry is set only once its copy is complete, so a reader
sees either a finished slot or -1, and -1 means "read the host block", which is always exact.

Slot ownership is generation-counted: `release` bumps the slot's generation, so a copy that was
queued (or running) for the previous owner is skipped (or not published) and a later owner's copy,
queued behind it on the one worker, overwrites the slot. Only the control plane (the model's
thread) assigns and releases slots, and it never reads a slot it released. A new owner takes the
free slot nearest its home slot (`home_slot`: uids laid out in order over the C slots), so one
layer's resident experts sit in a narrow window that the experts forward can read in place.

On CUDA the host blocks and the slot table are pinned host memory that the device reads in place
(`mapped.device_view`): the table is written by the host alone (a store, no copy to issue) and
read by the experts kernels of the decode step, which take each routed expert from its slot or, on
-1, straight from its mapped host block over the link (`mapped.gather_rows`), so a miss never waits
for a copy and needs nothing from the host. The copy worker copies on its own CUDA stream.

In thread mode (`control="thread"`) a released slot is refilled only once `posted.fence.ReadFence`
says no read of its previous owner can remain; in inline mode on CUDA, after an event recorded at
the release. Why a released slot is refilled only when safe: docs/decode.md, "The slot fence".

Emulated link (`link_s`, CPU benchmarks): a CPU machine has no link, so a miss would cost nothing
and foresight could not pay. With `link_s` set every expert row that crosses the link costs that
long: the copy worker sleeps it per copy, and a read of a host row sleeps it too, except that in
the inline mode a miss whose copy is already queued waits for that copy instead (the cost model's
demand copy: the layer waits for one copy, which goes ahead of queued prefetches). The in-place
reads and the worker's copies are not serialised against each other (a simplification: the one
real link would share its bandwidth between them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from seqmoe.base.errors import UserError
from seqmoe.brain.manager.host_tier import Stopped
from seqmoe.runtime.core.mapped import dequantizes, device_view, gather_dequantized, gather_rows

if TYPE_CHECKING:  # a posted part: core names its type only
    from seqmoe.runtime.posted.fence import ReadFence

_NEAR = 16  # how far from its home slot `assign` looks for a free slot before taking any


class ExpertPool:
    """Host blocks, device slots and the slot table of one model.

    Args:
        hosts: per MoE layer, [E, P] packed experts on the host (the only copy).
        capacity: C, slots in the device pool.
        device: where the pool and the table live.
        slots: the [C, P] device pool, when already allocated (`offload` allocates it first).
        fence: thread mode: the `ReadFence` that releases wait on (None: inline mode).
        link_s: emulated link, seconds per expert row crossing it (CPU only; None: the real link).
    """

    def __init__(self, hosts: list[torch.Tensor], capacity: int, device: torch.device, *,
                 slots: torch.Tensor | None = None, fence: ReadFence | None = None,
                 link_s: float | None = None) -> None:
        if capacity < 1:
            raise UserError(f"the device pool needs at least one slot, got {capacity}")
        if link_s is not None and device.type != "cpu":
            raise UserError(f"an emulated link is for a CPU pool (the {device.type} device has its own link)")
        self.link_s = link_s
        self.hosts = hosts
        self.num_layers = len(hosts)
        self.num_experts, self.numel = hosts[0].shape
        self.dtype = hosts[0].dtype
        self.device = device
        self.capacity = capacity
        if slots is None:
            slots = torch.empty((capacity, self.numel), dtype=self.dtype, device=device)
        self.pool = slots
        table = torch.full((self.num_layers, self.num_experts), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.table_host = table.numpy()  # written by the host only
        self.table = device_view(table, device)  # the same memory, as the device reads it
        self.cache = getattr(hosts[0], "cache", None)  # a disk tier's host cache (`seqmoe.runtime.disk.host_cache`), or None
        # The posted engine reads host rows in place on the device: each layer's block, or the host
        # cache's rows (a row the control thread holds for the step, `HostRelay`).
        self.hosts_device = [device_view(self.cache.buf, device)] * self.num_layers if self.cache is not None \
            else [device_view(h, device) for h in hosts]
        assigned = torch.zeros((self.num_layers, self.num_experts), dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.assigned_host = assigned.numpy()  # 1: the expert holds a slot (maybe still being copied); host-written
        self.assigned = device_view(assigned, device)
        self.device_reads = torch.zeros(2, dtype=torch.int64, device=device)  # (slot, host) reads of posted steps
        self._staging: torch.Tensor | None = None
        self._dequant: dict[str, torch.Tensor] | None = None  # `gather_posted_params`' buffers
        self._slots_posted: torch.Tensor | None = None  # the K slots a posted gather resolved
        self.fence = fence
        self._reuse: list[tuple[int, int] | None] = [None] * capacity  # what a refill waits for (thread mode)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot published or released (emulated link)
        self.failure: BaseException | None = None  # the copy worker's error: no queued copy will land
        self.slot_of: dict[int, int] = {}  # uid -> slot (assigned; maybe not yet copied)
        self.owner = [-1] * capacity
        self.gen = [0] * capacity
        self.loaded = [False] * capacity
        self.free = set(range(capacity))
        self._released_at: list = [None] * capacity  # CUDA events: last reads of a released slot
        self.pool_reads = self.host_reads = 0
        self.version = 0  # bumped by every table change (readers cache what they derive from the table)
        self.peak_gathered = 0  # most experts one `rows` call gathered (its transient buffer, see `rows`)

    @property
    def expert_bytes(self) -> int:
        return self.numel * self.pool.element_size()

    @property
    def device_bytes(self) -> int:
        """Bytes the pool occupies on the device (C slots)."""
        return self.pool.numel() * self.pool.element_size()

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the experts occupy (the host cache's rows with a disk tier)."""
        if self.cache is not None:
            return self.cache.nbytes
        return sum(h.numel() * h.element_size() for h in self.hosts)

    def _split(self, uid: int) -> tuple[int, int]:
        return divmod(uid, self.num_experts)

    # -- control plane (model thread) ---------------------------------------------------------------
    def assign(self, uid: int) -> tuple[int, int]:
        """Give `uid` a free slot; (slot, generation) for its copy. RuntimeError if none is free."""
        if uid in self.slot_of:
            raise RuntimeError(f"expert {uid} already holds slot {self.slot_of[uid]}")
        if not self.free:
            raise RuntimeError("no free slot: the control plane loaded more experts than the pool holds")
        slot = self._pick_slot(uid)
        with self._lock:
            self.gen[slot] += 1
            self.owner[slot] = uid
            self.loaded[slot] = False
            self.slot_of[uid] = slot
            self.assigned_host[self._split(uid)] = 1
            return slot, self.gen[slot]

    def home_slot(self, uid: int) -> int:
        """The slot `uid` takes when it is free: uids spread in order over the pool (slot = uid at
        full residency), so a layer's experts sit in a narrow window of slots (see `experts`)."""
        return uid * self.capacity // (self.num_layers * self.num_experts)

    def _pick_slot(self, uid: int) -> int:
        """Take the free slot nearest to `uid`'s home slot (searching a few either side), else any."""
        free, home = self.free, self.home_slot(uid)
        for d in range(_NEAR):
            for slot in (home - d, home + d):
                if slot in free:
                    free.remove(slot)
                    return slot
        return free.pop()

    def release(self, uid: int) -> None:
        """`uid` leaves the pool: unpublish it and free its slot (a pending copy of it is dropped)."""
        slot = self.slot_of.pop(uid)
        layer, e = self._split(uid)
        with self._lock:
            self.gen[slot] += 1
            self.owner[slot] = -1
            self.loaded[slot] = False
            self.assigned_host[layer, e] = 0
            self._publish(layer, e, -1)
            if self.fence is not None:
                self._reuse[slot] = self.fence.released(self.version)
        if self.fence is None and self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()  # reads of this slot queued so far on the model's stream
            self._released_at[slot] = ev
        self.free.add(slot)

    def _publish(self, layer: int, e: int, slot: int) -> None:
        self.table_host[layer, e] = slot
        self.version += 1
        self._changed.notify_all()
        if self.fence is not None:
            self.fence.publish(self.version)  # after the table store (see the module docstring)

    # -- copy worker ----------------------------------------------------------------------------------
    def wanted(self, uid: int, slot: int, gen: int) -> bool:
        """The copy (uid -> slot, generation) is still current and not done yet."""
        return self.gen[slot] == gen and self.owner[slot] == uid and not self.loaded[slot]

    def fill(self, uid: int, slot: int, gen: int, stop: Callable[[], bool] = lambda: False) -> bool:
        """Copy `uid`'s host block into `slot`, then publish it unless the slot changed hands; True if
        published. Thread mode: first waits until no read of the slot's previous owner can remain
        (or the copy went stale, or `stop()`)."""
        layer, e = self._split(uid)
        if not self._await_readers(uid, slot, gen, stop):
            return False
        if self.cache is None:
            self._copy_in(self.hosts[layer][e], slot)
        else:
            try:
                with self.cache.hold(uid, stop) as src:  # the row stays put until its copy is done
                    self._copy_in(src, slot)
            except Stopped:  # the worker closes while every row is held by what will never release it
                return False
        with self._lock:
            if self.gen[slot] != gen or self.owner[slot] != uid:
                return False
            self.loaded[slot] = True
            self._publish(layer, e, slot)
            return True

    def _copy_in(self, src: torch.Tensor, slot: int) -> None:
        """Copy host row `src` into `slot`, complete when this returns."""
        dst = self.pool[slot]
        if self.device.type == "cuda":
            ev = self._released_at[slot]
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
            dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream().synchronize()
        else:
            dst.copy_(src)

    def _await_readers(self, uid: int, slot: int, gen: int, stop: Callable[[], bool]) -> bool:
        token = self._reuse[slot]
        if token is None:
            return True
        t0 = time.perf_counter()
        while not self.fence.ready(token):
            if stop() or not self.wanted(uid, slot, gen):
                return False
            # A few layers' worth of short sleeps, then longer ones: the wait ends when the device
            # acknowledges or completes its work, so it never spins for long.
            time.sleep(20e-6 if time.perf_counter() - t0 < 2e-3 else 500e-6)
        return True

    # -- readers (experts forward, model thread) ---------------------------------------------------
    def rows(self, layer: int, experts: list[int], host_only: bool = False) -> torch.Tensor:
        """[n, P] packed weights of `experts` of `layer`: the pool slot when published (unless
        `host_only`), else the host block.

        The result is a transient gather buffer on the device, freed when the layer's experts are
        done: K experts for a decode step, up to E for a prompt forward. A fused kernel reading
        the slots and the mapped host blocks in place (the CUDA design above) needs none.
        """
        self.peak_gathered = max(self.peak_gathered, len(experts))
        if not experts:
            return self.pool.new_empty((0, self.numel))
        table, host, parts, crossed = self.table_host[layer], self.hosts[layer], [], 0
        for e in experts:
            slot = -1 if host_only else int(table[e])
            if slot < 0 and (self.link_s or self.cache is not None) and self.fence is None and not host_only:
                slot = self._await_copy(layer * self.num_experts + e)  # one copy of the row, not two
            if slot >= 0:
                parts.append(self.pool[slot])
                self.pool_reads += 1
            else:
                parts.append(host[e].to(self.device, non_blocking=True))
                self.host_reads += 1
                crossed += 1
        if self.link_s and crossed:
            time.sleep(crossed * self.link_s)
        return torch.stack(parts)

    def _await_copy(self, uid: int) -> int:
        """Emulated link or disk tier, inline mode: wait for `uid`'s queued copy; its slot, or -1 if it has none
        (or the copy did not land within a generous time, e.g. the worker stopped: the host row is
        read instead, which is always exact)."""
        slot = self.slot_of.get(uid)
        if slot is None:
            return -1
        with self._changed:
            self._changed.wait_for(lambda: self.loaded[slot] or self.owner[slot] != uid or self.failure is not None,
                                   timeout=max(1.0, 1000 * (self.link_s or 0.0), 60.0 * (self.cache is not None)))
            if not (self.loaded[slot] and self.owner[slot] == uid):
                self.raise_failure()
            return slot if self.loaded[slot] and self.owner[slot] == uid else -1

    def fail(self, error: BaseException) -> None:
        """The copy worker died of `error`: wake whoever waits for a copy, which will not land."""
        with self._changed:
            self.failure = error
            self._changed.notify_all()

    def raise_failure(self) -> None:
        """Raise the copy worker's error, if it died of one (a UserError, e.g. a checkpoint changed on disk, as it is)."""
        if isinstance(self.failure, UserError):
            raise self.failure
        if self.failure is not None:
            raise RuntimeError(f"the expert copy worker failed: {self.failure!r}") from self.failure

    def gather_posted(self, layer: int, ids: torch.Tensor, skip: torch.Tensor | None = None,
                      host_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[n, P] rows of the routed `ids` [n] (device tensor), with no host value read: each from its
        slot, or on a miss from the mapped host block (`mapped.gather_rows`). The reads are counted
        on the device (`device_reads`). The buffers are shared by all layers. `skip` [n] bool:
        positions nobody reads (zero rows: nothing read, nothing charged); `host_ids` [n]: with a disk
        tier, the host cache's row of each position's expert (the block is the cache's rows)."""
        n = ids.shape[0]
        if self._staging is None or self._staging.shape[0] != n:
            self._staging = torch.empty((n, self.numel), dtype=self.dtype, device=self.device)
            self._slots_posted = torch.empty((n,), dtype=torch.int32, device=self.device)
            self.peak_gathered = max(self.peak_gathered, n)
        rows = gather_rows(self.pool, self.hosts_device[layer], self.table[layer], ids.contiguous(), self._staging,
                           self.device_reads, self._slots_posted, skip, host_ids)
        if self.link_s:  # a CPU pool: the missed rows were read in place over the emulated link
            time.sleep(int((self._slots_posted == -1).sum()) * self.link_s)
        return rows

    def gather_posted_params(self, layer: int, ids: torch.Tensor, layout, skip: torch.Tensor | None = None,
                             host_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`layout.views` of `gather_posted`'s rows: for an int8 or int4 store (or a shipped one of FP8
        blocks, MXFP4, Q8_0) on CUDA read and dequantized in one pass (`mapped.gather_dequantized`), into
        buffers shared by all layers."""
        if not dequantizes(layout, self.device):
            return layout.views(self.gather_posted(layer, ids, skip, host_ids))
        n = ids.shape[0]
        if self._dequant is None or self._slots_posted is None or self._slots_posted.shape[0] != n:
            self._dequant = {name: torch.empty((n, math.prod(shape)), dtype=layout.compute_dtype, device=self.device)
                             for name, shape in zip(layout.names, layout.shapes)}
            self._slots_posted = torch.empty((n,), dtype=torch.int32, device=self.device)
            self.peak_gathered = max(self.peak_gathered, n)
        return gather_dequantized(self.pool, self.hosts_device[layer], self.table[layer], ids.contiguous(), layout,
                                  self._dequant, self.device_reads, self._slots_posted, skip, host_ids)

    def missing_row(self, layer: int) -> np.ndarray:
        """[E] bool: the experts of `layer` that hold no slot (neither published nor being copied in)."""
        return self.assigned_host[layer] == 0

    def resident(self) -> set[int]:
        """uids whose slot is published (copy complete)."""
        t = self.table_host
        return {int(l) * self.num_experts + int(e) for l, e in zip(*np.nonzero(t >= 0))}

    def load_now(self, uid: int) -> None:
        """Assign a slot to `uid` and copy it synchronously (the start placement)."""
        slot, gen = self.assign(uid)
        if not self.fill(uid, slot, gen):
            raise RuntimeError(f"start placement copy of expert {uid} was not published")

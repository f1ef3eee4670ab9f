"""The disk tier on the driver's clock: a host cache of H expert rows (`HostTier`) in front of one
disk, under the device pool's manager, which stays as it is (docs/DESIGN.md, "The disk tier").

    disk = DiskClock(HostTier(H, L, E, policy=host_policy(system), read_s=d, start=start), model=..., hardware=...)
    manager = build_manager(system, ..., observer=disk.observer(inner),  # inner: the runtime's, or None
                            on_forecast=disk.note_forecast)
    driver = Driver(manager, disk=disk); disk.attach(manager)

The series rule: every transfer the manager orders (a copy, an in-place read, a host-CPU expert)
first `need`s its row in the host tier at the time of the call that ordered it, and cannot end
before the row is in host memory plus its own cost. At each reveal the layer's experts start no
earlier than the latest such end among its routed experts (host-CPU experts: the layer ends no
earlier than theirs); the wait is stall (`manager.add_stall`) and is counted as `disk_stall_s`.
"""

from __future__ import annotations

import math

import numpy as np

from seqmoe.brain.manager.host_tier import HostTier, host_rows_for
from seqmoe.brain.manager.miss_paths import MissPath
from seqmoe.base.errors import UserError
from seqmoe.costs.precision import format_bytes, parse_bytes
from seqmoe.costs.profiles import HardwareProfile, ModelProfile, copy_time_s, disk_read_s
from seqmoe.costs.host_cost import host_expert_time_s

AHEAD_LIMIT = 8
"""Rows the forecast policy may read ahead at one token start (one at a time, the disk idle)."""


def host_rows(host_memory, host_residency, model: ModelProfile, hardware: HardwareProfile,
              twin_bytes: int = 0) -> int | None:
    """H for `--host-memory` (bytes or a size; rows of the store's `model.expert_bytes`, after
    `twin_bytes` of low-bit twins, which live in the same memory) or `--host-residency` (a fraction
    of L x E rows; twins beside them); None with neither (no disk tier). UserError for both, a
    malformed size, a residency outside (0, 1], a cache smaller than the tier's minimum, or a
    hardware profile without a disk."""
    if host_memory is None and host_residency is None:
        return None
    if host_memory is not None and host_residency is not None:
        raise UserError("give --host-memory or --host-residency, not both")
    disk_read_s(model, hardware)  # a profile with a disk, else the UserError naming the presets that have one
    L, E, K = model.num_layers, model.num_experts, model.top_k
    if host_memory is not None:
        budget = parse_bytes(host_memory, "--host-memory")
        what = f"--host-memory {format_bytes(budget)}"
    else:
        if not (isinstance(host_residency, (int, float)) and 0 < host_residency <= 1):
            raise UserError(f"--host-residency must be in (0, 1], got {host_residency!r}")
        budget = math.floor(host_residency * L * E + 1e-9) * model.expert_bytes
        what = f"--host-residency {host_residency}"
    return host_rows_for(budget, model.expert_bytes, L, E, K, what, twin_bytes if host_memory is not None else 0)


class DiskClock:
    """The host tier and the disk's clock beside a manager: what the driver calls (`Driver(disk=...)`).

    Args:
        tier: the host cache's rows and policy (its `read_s` is the disk's time per expert).
        model, hardware: the cost model (copy and host-CPU times of the transfers from host rows).
    """

    def __init__(self, tier: HostTier, *, model: ModelProfile, hardware: HardwareProfile) -> None:
        self.tier = tier
        self.copy_s = copy_time_s(model, hardware)
        h = host_expert_time_s(model, hardware)
        self.host_s = math.inf if h is None else h
        n = tier.num_layers * tier.num_experts
        self.until = np.zeros(n)  # per uid: the latest end of a transfer from its row (ready + own cost)
        self.current = np.zeros(n, dtype=bool)  # the current layer's routed uids: their rows stay
        self._current = np.zeros(0, dtype=np.int64)
        self.on_host: set[int] = set()  # the current layer's uids served on the host CPU
        self.now = 0.0  # the clock of the manager call being made (its events happen then)
        self.host_floor = 0.0  # the current layer's host-CPU experts end no earlier
        self.stall_s = 0.0

    # -- wiring ------------------------------------------------------------------------------------
    def observer(self, inner=None) -> DiskObserver:
        """The manager's observer: needs each transferred row here, then tells `inner` (if any)."""
        return DiskObserver(self, inner)

    def attach(self, manager) -> None:
        """Show the tier `manager`'s pool (`HostTier.watch`); the manager tells `note_forecast` of its
        forecasts (built with `on_forecast=clock.note_forecast`)."""
        if self.tier.policy == "forecast":
            self.tier.watch(resident=manager.present_mask)

    def note_forecast(self, step: int, forecast) -> None:
        """A forecast of the manager's predictor: the forecast policy of the tier reads it too."""
        if self.tier.policy == "forecast":
            self.tier.note_forecast(step, forecast)

    # -- the driver's calls --------------------------------------------------------------------------
    def token_start(self, now: float) -> None:
        """A token starts at `now` (before the manager's token start: its events happen then)."""
        self.now = now
        self._set_current(())
        self.tier.begin_token()

    def after_token_start(self) -> None:
        """The manager has decided at the token start: the forecast policy reads ahead while the disk is free."""
        t = self.tier
        if t.policy != "forecast" or t.disk_free_at > self.now:
            return
        for _ in range(AHEAD_LIMIT):  # one row at a time, so a row just read ahead is busy for the next
            if not t.plan_ahead(self.now, limit=1, busy=self._busy(), idle_only=False):
                break

    def before_layer(self, uids, reveal: float) -> None:
        """The router revealed `uids` at `reveal` (before the manager serves them)."""
        self.now, self.host_floor = reveal, 0.0
        self._set_current(uids)
        self.tier.observe(self._current)

    def after_layer(self, manager, start: float) -> float:
        """The manager said the experts start at `start`: no earlier than their rows' transfers end."""
        uids = self._current
        if self.on_host:  # served on the host CPU this layer (a copy may follow: the layer does not wait for it)
            uids = np.setdiff1d(uids, np.fromiter(self.on_host, dtype=np.int64, count=len(self.on_host)))
        t = float(self.until[uids].max()) if len(uids) else start
        if t > start:
            manager.add_stall(t - start)
            self.stall_s += t - start
            return t
        return start

    def layer_end(self, end: float, host_end: float) -> float:
        """The layer's device work ends at `end`, its host outputs at `host_end`: when its host
        outputs are back given their rows (the extra wait counted as disk stall)."""
        if self.host_floor > max(end, host_end):
            self.stall_s += self.host_floor - max(end, host_end)
            return self.host_floor
        return host_end

    def at(self, now: float) -> None:
        """A manager call without a reveal (a layer's end) is made at `now`."""
        self.now = now

    # -- internals -------------------------------------------------------------------------------------
    def _set_current(self, uids) -> None:
        self.current[self._current] = False
        self._current = np.asarray(uids, dtype=np.int64).reshape(-1)
        self.current[self._current] = True
        self.on_host.clear()

    def _busy(self) -> np.ndarray | None:
        """[H] rows that must stay: the current layer's, reads in flight, transfers from them in flight
        (relaxed to the current layer's when that is every row, then to none)."""
        t = self.tier
        owner = t.owner
        held = owner >= 0
        safe = np.where(held, owner, 0)
        cur = held & self.current[safe]
        busy = cur | (held & ((self.until[safe] > self.now) | (t.ready_at[safe] > self.now)))
        if busy.all():
            busy = cur if not cur.all() else None
        return busy

    def need(self, uid: int, cost: float, starts_layer: bool = True) -> float:
        """A transfer of `cost` seconds from `uid`'s row is ordered now: its earliest end (which the
        experts' start waits for when `starts_layer`)."""
        t = self.tier
        busy = self._busy() if t.row_of[uid] < 0 and (t.owner >= 0).all() else None
        end = t.need(uid, self.now, busy) + cost
        if starts_layer and end > self.until[uid]:
            self.until[uid] = end
        return end

    def fill(self, c) -> None:
        """Write the tier's counts into `c` (`SimCounts`)."""
        t = self.tier
        c.host_rows, c.disk_reads, c.disk_read_s, c.disk_stall_s = t.rows, t.reads, t.read_s, self.stall_s
        c.host_hits, c.host_needs = t.hits, t.hits + t.reads - t.ahead_reads
        c.disk_ahead_reads, c.disk_ahead_used = t.ahead_reads, t.ahead_used


class DiskObserver:
    """The manager's observer with a disk tier: each copy, in-place read or host-CPU expert needs its
    row first (`DiskClock.need`); every event then goes on to `inner` unchanged."""

    def __init__(self, clock: DiskClock, inner=None) -> None:
        self.clock, self.inner = clock, inner

    def on_load(self, uid: int, demand: bool, deadline_step: int) -> None:
        self.clock.need(uid, self.clock.copy_s)
        if self.inner is not None:
            self.inner.on_load(uid, demand, deadline_step)

    def on_promote(self, uid: int) -> None:
        if self.inner is not None:
            self.inner.on_promote(uid)

    def on_evict(self, uid: int) -> None:
        if self.inner is not None:
            self.inner.on_evict(uid)

    def on_off_pool(self, uid: int, path: MissPath) -> None:
        clock = self.clock
        if path.on_host_cpu:  # overlaps the device's experts: it bounds the layer's end, not its start
            end = clock.need(uid, clock.host_s, starts_layer=False)
            clock.on_host.add(uid)
            clock.host_floor = max(clock.host_floor, end)
        elif path.twin:  # its twin is in host memory: nothing to read from disk
            pass
        else:
            clock.need(uid, clock.copy_s)
        if self.inner is not None:
            self.inner.on_off_pool(uid, path)

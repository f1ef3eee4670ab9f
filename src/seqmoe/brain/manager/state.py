"""The memory manager's state machine: slots, the copy channel, and the system deciding over them.

docs/DESIGN.md's protocol, one position (token, layer) at a time. Each token first pays the non-MoE
time (dense layers, lm_head), then passes the L MoE layers. At a layer: the non-expert part
(attention, router) runs, the router reveals the K experts, the experts run once all of them are
present. At the reveal the system decides: eviction for demand copies, then the predictor observes
and the scheduler may issue prefetches. A second decision point sits at the start of each token
(the token id is known there) and, for schedulers that replan, a third after each layer's experts.

    manager = MemoryManager(system, model=..., hardware=..., capacity=C, start=placement)
    driver = Driver(manager)     # seqmoe.brain.manager.driver: the virtual clock and the call order

The simulator (`seqmoe.sim.simulate`) drives it over a trace; the runtime (`seqmoe.runtime`) drives
the very same object live, with an `observer` that mirrors every load and eviction into real slots.
"""

from __future__ import annotations

import time

import numpy as np

from seqmoe.brain.manager.base import PACE_WEIGHT, ManagerBase, PoolObserver, System
from seqmoe.brain.manager.counts import SimCounts
from seqmoe.brain.manager.channel import CopyChannel, in_place_key, twin_key
from seqmoe.brain.manager.miss_paths import CPU, IN_PLACE, TWIN, auto_path, pick_twins, twin_waits_for_cpu
from seqmoe.costs.profiles import HardwareProfile, ModelProfile

class MemoryManager(ManagerBase):
    """Slots, copy channel and counts of one run, decided by `system` (Python objects, any policy,
    predictor and scheduler); also the `PoolView` its scheduler sees. Arguments: `ManagerBase`."""

    def __init__(self, system: System, *, model: ModelProfile, hardware: HardwareProfile, capacity: int, start,
                 observer: PoolObserver | None = None, on_forecast=None) -> None:
        super().__init__(system, model=model, hardware=hardware, capacity=capacity, start=start, observer=observer,
                         on_forecast=on_forecast)
        self.channel = CopyChannel(self.copy_time_s, self.num_layers * self.num_experts, self.twin_time_s)
        n = self.num_layers * self.num_experts
        self._present = bytearray(n)
        self._unused_prefetch = bytearray(n)
        self.pinned: set[int] = set()  # copies not finished, plus the current layer's experts
        self._pending: set[int] = set()  # copies not finished
        for uid in start:
            self._present[int(uid)] = 1
        self.num_present = len(start)
        system.policy.reset([int(u) for u in start])
        self.c = SimCounts()
        self.step, self.now = -1, 0.0
        self.pace_s = self.layer_s  # measured time per layer (moving average), stalls included
        self.host_served, self.host_end = 0, 0.0
        """Experts of the current layer on the host CPU, and when the last of them is back (the driver reads them)."""
        self._twin_left = 0.0  # the current token's twin budget not yet spent

    def add_stall(self, seconds: float) -> None:
        """The driver's share of the stall: the layer waited `seconds` for the host CPU's outputs."""
        self.c.stall_s += seconds

    def _read_in_place(self, uid: int, activations: int, step: int, reveal: float, waiting: list) -> None:
        """Serve the miss of `uid` (its `activations` rows) by an in-place read queued at `reveal`;
        the layer waits for it."""
        key = in_place_key(uid)
        self.channel.demand(key, reveal)
        waiting.append(key)
        self.c.in_place += activations
        if self.observer is not None:
            self.observer.on_off_pool(uid, IN_PLACE)
        self.system.policy.note_use(uid, step)

    def _on_host(self, uid: int, now: float, activations: int = 1) -> None:
        """Serve `uid` on the host CPU from `now` (one pass over it for its `activations` rows)."""
        self.host_end = self.lane.run(now)
        self.host_served += 1
        self.c.host += activations
        if self.observer is not None:
            self.observer.on_off_pool(uid, CPU)

    @property
    def copies(self) -> int:
        """Copies started so far, demand and prefetch."""
        return self.channel.started

    def finish(self) -> None:
        """The run ended: every queued copy runs (and counts)."""
        self.channel.advance(float("inf"))

    # -- PoolView -------------------------------------------------------------------------------
    def present(self, uid: int) -> bool:
        return bool(self._present[uid])

    def present_mask(self) -> np.ndarray:
        return np.frombuffer(self._present, dtype=np.uint8)

    def readable_mask(self, now: float) -> np.ndarray:
        """[L * E] bool: resident with its copy done by `now` (the copies due by then finish first)."""
        self._finish_copies(now)
        ready = np.frombuffer(self._present, dtype=np.uint8).astype(bool)
        ready[list(self._pending)] = False
        return ready

    def eta(self, step):
        tokens_crossed = step // self.num_layers - self.step // self.num_layers
        return self.now + (step - self.step) * self.pace_s + tokens_crossed * self.token_s

    def backlog_end(self) -> float:
        return self.channel.backlog_end(self.now)

    def victim(self, incoming: int) -> int | None:
        if self.num_present < self.capacity:
            return None
        return self.system.policy.victim(incoming, self.pinned)

    def prefetch(self, uid: int, deadline_step: int, victim: int | None = None) -> bool:
        if self._present[uid]:
            return True
        if not self._make_room(uid, victim):
            return False
        self._load(uid, self.step)
        self._unused_prefetch[uid] = 1
        self.c.prefetches += 1
        self.channel.prefetch(uid, deadline_step, self.now)
        if self.observer is not None:
            self.observer.on_load(uid, False, deadline_step)
        return True

    def cancel(self, uid: int) -> bool:
        if uid not in self._pending or not self._unused_prefetch[uid] or not self.channel.cancel(uid):
            return False  # not a queued prefetch: running, done, a demand copy, or needed now
        self._free_cancelled(uid)
        return True

    # -- internals ------------------------------------------------------------------------------
    def _make_room(self, incoming: int, victim: int | None = None) -> bool:
        if self.num_present < self.capacity:
            return True
        if victim is not None and self._present[victim]:
            if victim in self.pinned:
                return False
            v = victim
        else:
            v = self.system.policy.victim(incoming, self.pinned)
        if v is None:
            return False
        self.system.policy.remove(v)
        self._present[v] = 0
        self.num_present -= 1
        if self.observer is not None:
            self.observer.on_evict(v)
        if self._unused_prefetch[v]:
            self._unused_prefetch[v] = 0
            self.c.wasted_copies += 1
        return True

    def _reclaim_prefetch(self, needed: list[int]) -> bool:
        """Every slot is pinned: cancel the queued prefetch needed last and take its slot."""
        uid = self.channel.cancel_latest_prefetch(needed)
        if uid is None:
            return False
        self._free_cancelled(uid)
        return True

    def _await_running(self, uid: int, needed: list[int], added: list[int]) -> bool:
        """Every slot holds this layer's experts or a copy already started (at capacity K with a
        prefetch in flight). The demand copy of `uid` would queue behind the running copy anyway:
        let that copy land first (a prefetch for a later layer then becomes evictable, its copy
        wasted; an expert of this layer stays pinned to the layer's end) and make room."""
        t = self.channel.running_until()
        if t is None:
            return False
        keep = set(needed)
        for u in self.channel.advance(t):
            self._pending.discard(u)
            if u in keep:
                added.append(u)  # unpinned with the layer's other experts at its end
            else:
                self.pinned.discard(u)
        return self._make_room(uid)

    def _free_cancelled(self, uid: int) -> None:
        """A queued prefetch of `uid` was cancelled before its copy started: give its slot back."""
        self.system.policy.remove(uid)
        self._present[uid] = self._unused_prefetch[uid] = 0
        self._pending.discard(uid)
        self.pinned.discard(uid)
        self.num_present -= 1
        self.c.cancelled += 1
        if self.observer is not None:
            self.observer.on_evict(uid)

    def _load(self, uid: int, step: int) -> None:
        self._present[uid] = 1
        self.num_present += 1
        self._pending.add(uid)
        self.pinned.add(uid)
        self.system.policy.insert(uid, step)

    def _finish_copies(self, t: float) -> None:
        for uid in self.channel.advance(t):
            self._pending.discard(uid)
            self.pinned.discard(uid)

    def _decide(self, ids) -> None:
        sys = self.system
        if self.predictor is not None and ids is not None:
            self.predictor.observe(self.step, ids)
        if sys.prefetcher is not None:
            forecast = self._forecast(self.step) if self.predictor is not None else None
            sys.prefetcher.plan(forecast, self)

    def layer(self, step: int, needed: list[int], ids: np.ndarray | None, reveal: float, weights=None,
              mult=None) -> float:
        """Serve one layer whose router reveals `needed` (distinct uids) at time `reveal` (their gate
        `weights`, read by the twin path), `mult[i]` activations of `needed[i]` (one each when None:
        batch 1); hits and misses count per activation, an expert is copied or read once; returns
        expert start."""
        if mult is None:
            mult = [1] * len(needed)
        self.step, self.now = step, reveal
        self._finish_copies(reveal)
        c, policy, channel, present = self.c, self.system.policy, self.channel, self._present
        if self.host_only:
            for uid, m in zip(needed, mult):
                c.misses += m
                self._on_host(uid, reveal, m)
            return reveal
        pinned = self.pinned
        added = [u for u in needed if u not in pinned]
        pinned.update(added)
        t0 = time.perf_counter()
        start, waiting = reveal, []
        for uid, m in zip(needed, mult):
            if not present[uid]:
                continue
            if uid in self._pending:  # issued before the reveal: a hit, late
                c.late += m
                done = channel.done_at.get(uid)
                if done is None:  # still queued: the layer needs it now
                    channel.promote(uid, reveal)
                    waiting.append(uid)
                    if self.observer is not None:
                        self.observer.on_promote(uid)
                elif done > start:
                    start = done
            else:
                c.ready += m
            self._unused_prefetch[uid] = 0
            policy.access(uid, step)
        twins = None
        if self.twin is not None:
            self._check_weights(weights)
            missing = np.array([not present[u] for u in needed])
            if missing.any():
                twins = pick_twins(missing, weights, self._twin_left)
        for i, uid in enumerate(needed):
            if present[uid]:
                continue
            m = mult[i]
            c.misses += m
            if twins is not None and twins[i] and not twin_waits_for_cpu(self, reveal):
                w = float(weights[i])
                self._twin_left -= w
                c.twin += 1
                c.twin_weight += w
                key = twin_key(uid, len(present))
                channel.demand(key, reveal)
                waiting.append(key)
                if self.observer is not None:
                    self.observer.on_off_pool(uid, TWIN)
                policy.note_use(uid, step)
                continue
            path, victim = auto_path(self, uid, reveal)
            if path.on_host_cpu:
                self._on_host(uid, reveal, m)
                if path.takes_slot:  # copied in behind: the policy hears of the use when the copy lands
                    self.prefetch(uid, step + self.num_layers, victim)
                else:
                    policy.note_use(uid, step)
                continue
            if not path.takes_slot:
                self._read_in_place(uid, m, step, reveal, waiting)
                continue
            if not (self._make_room(uid, victim) or self._reclaim_prefetch(needed)
                    or self._await_running(uid, needed, added)):
                # Every slot holds this layer's experts (a batch's layer may route more than C) or a
                # copy in flight: the row is read in place.
                self._read_in_place(uid, m, step, reveal, waiting)
                continue
            self._load(uid, step)
            channel.demand(uid, reveal)
            if self.observer is not None:
                self.observer.on_load(uid, True, step)
            policy.access(uid, step)
            waiting.append(uid)
        if waiting:
            finish = channel.demand_finish_times()
            for uid in waiting:
                t = finish.get(uid, channel.done_at.get(uid, reveal))
                if t > start:
                    start = t
        self._decide(ids)
        c.decision_s += time.perf_counter() - t0
        for uid in added:
            if uid not in self._pending:
                pinned.discard(uid)
        c.stall_s += start - reveal
        # The pace includes stalls, so deadlines follow the speed the run really has.
        self.pace_s += PACE_WEIGHT * (self.layer_s + start - reveal - self.pace_s)
        return start

    def layer_end(self, step: int, now: float) -> None:
        """The layer at `step` finished computing: its experts unpin; some prefetchers plan again."""
        self.step, self.now = step, now
        self._finish_copies(now)
        t0 = time.perf_counter()
        self.system.prefetcher.plan(None, self)
        self.c.decision_s += time.perf_counter() - t0

    def token_start(self, step: int, now: float, token_id: int | None) -> None:
        self.step, self.now = step - 1, now
        self._finish_copies(now)
        e = self.channel
        self._note_channel(now, e.started + e.reads, e.twin_reads)
        if self.twin is not None:  # a step of B rows spends B tokens' budgets
            self._twin_left = self.twin.budget * (len(token_id) if isinstance(token_id, list) else 1)
        pred, pre = self.predictor, self.system.prefetcher
        if pred is None and pre is None:
            return
        t0 = time.perf_counter()
        if pred is not None:
            pred.begin_token(step, token_id)
            prior = pred.take_prior()
            if prior is not None:
                self.system.policy.set_prior(*prior)
            far = pred.far
            if far is not None:
                self.system.policy.set_far(far)
        self._decide(None)
        self.c.decision_s += time.perf_counter() - t0



"""What every memory manager shares (`state.MemoryManager`, `compiled.CompiledManager`): the system
deciding, the observer of slot changes, and `ManagerBase`: dimensions, the cost model, the miss
paths' setup, the channel's busy share, the checks of their inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


from seqmoe.brain.policies.base import EvictionPolicy
from seqmoe.base.errors import Note, UserError
from seqmoe.costs.host_cost import host_expert_time_s
from seqmoe.brain.manager.channel import HostLane
from seqmoe.brain.manager.miss_paths import MissPath, Twin, miss_rule
from seqmoe.brain.manager.placement import check_capacity
from seqmoe.brain.predict.base import Predictor
from seqmoe.brain.predict.lanes import LanePredictors
from seqmoe.costs.profiles import HardwareProfile, ModelProfile, copy_time_s, layer_times_s, token_overhead_s
from seqmoe.brain.schedule.base import Prefetcher

PACE_WEIGHT = 0.05
"""Moving-average weight of the newest layer in the measured pace."""
CHANNEL_WEIGHT = 0.05
"""Weight of each token in the moving average of the channel's busy share (about 20 tokens' memory)."""


@dataclass
class System:
    """A memory manager's decision makers: eviction policy, optionally a predictor and a prefetch scheduler."""

    name: str
    policy: EvictionPolicy
    predictor: Predictor | None = None
    prefetcher: Prefetcher | None = None
    miss: str = "copy"
    """How misses are served (`seqmoe.brain.manager.miss_paths.MISS_PATHS`)."""
    host_only: bool = False
    """Every routed expert runs on the host CPU, resident or not (no slot is used: `cpu-all`)."""
    twin: Twin | None = None
    """Low-bit twins serve the misses of small gate weight (`seqmoe.brain.manager.miss_paths.Twin`); None: off."""


class ReferenceManagerWarning(Note):
    """A system runs on the reference manager (Python): the same decisions and counts as compiled,
    at a higher cost per decision."""


class PoolObserver(Protocol):
    """Hears about slot changes as the state machine decides them (the runtime's data plane mirrors them)."""

    def on_load(self, uid: int, demand: bool, deadline_step: int) -> None:
        """`uid` got a slot and its copy was queued (a demand copy, or a prefetch due by `deadline_step`)."""

    def on_promote(self, uid: int) -> None:
        """The queued prefetch of `uid` is needed now: it moves to the demand queue."""

    def on_evict(self, uid: int) -> None:
        """`uid` lost its slot (evicted, or its queued prefetch cancelled)."""

    def on_off_pool(self, uid: int, path: MissPath) -> None:
        """The current layer's `uid` is served without a slot, by `path` (one of `miss_paths.OFF_POOL`):
        computed on the host CPU, read from its host row, or its low-bit twin read from host memory."""


class ManagerBase:
    """What every memory manager shares: dimensions, the cost model, the checks of its inputs.

    Args:
        system: the decision makers.
        model, hardware: the cost model (L, E, K come from the model profile).
        capacity: C, slots in the pool (at least K).
        start: the start placement, at most C uids (`seqmoe.brain.manager.start_placement`).
        observer: told of every load, promotion and eviction (the runtime's data plane).
        on_forecast: told of every forecast the predictor makes, `on_forecast(step, forecast)` (the
            disk tier's host cache reads it), or None.
    """

    takes_arrays = False
    """`layer` takes the routed uids as an int64 array (else as a list of ints)."""

    def __init__(self, system, *, model: ModelProfile, hardware: HardwareProfile, capacity: int, start,
                 observer: PoolObserver | None = None, on_forecast=None) -> None:
        self.observer, self.on_forecast = observer, on_forecast
        self.num_layers, self.num_experts, self.top_k = model.num_layers, model.num_experts, model.top_k
        check_capacity(capacity, self.top_k)
        if len(start) > capacity:
            raise UserError(f"start placement of {len(start)} experts exceeds the {capacity} slots")
        self.capacity = capacity
        self.system = system
        self.non_expert_s, self.per_expert_s = layer_times_s(model, hardware)
        self.token_s = token_overhead_s(model, hardware)
        self.layer_s = self.non_expert_s + self.top_k * self.per_expert_s
        self.copy_time_s = copy_time_s(model, hardware)
        self.miss, self.host_only = miss_rule(system.miss), system.host_only
        self.host_expert_s = host_expert_time_s(model, hardware)
        if self.host_expert_s is None and (self.miss.always_host_cpu or self.host_only):
            raise UserError(f"system {system.name!r} computes experts on the host CPU, but hardware profile "
                            f"{hardware.name!r} describes no host: give host_cores and host_memory_bytes_per_s")
        self.lane = HostLane(self.host_expert_s) if self.host_expert_s is not None else None
        self.twin, self.twin_time_s, self.twin_bytes = system.twin, None, 0
        if self.twin is not None:
            if self.host_only:
                raise UserError(f"system {system.name!r} computes every expert on the host CPU: a twin has no miss to serve")
            twin_model = model.at_precision(self.twin.precision)
            if twin_model.expert_bytes >= model.expert_bytes:
                raise UserError(f"a {self.twin.precision} twin ({twin_model.expert_bytes} bytes) is not smaller than the "
                                f"stored experts ({model.expert_bytes} bytes): choose a lower twin precision")
            self.twin_time_s, self.twin_bytes = copy_time_s(twin_model, hardware), twin_model.expert_bytes
        self.channel_use = 0.5
        """Share of time the copy channel is busy: a moving average over tokens, updated at each token start."""
        self._channel_mark = (0.0, 0, 0)  # (time, transfers started, twin reads started) at the last token start
        self.replans = system.prefetcher is not None and system.prefetcher.replan_after_compute
        """Wants `layer_end` after each layer's experts (the driver skips the call otherwise)."""
        self.wants_ids = system.predictor is not None
        """Reads the routed expert ids at each reveal (a predictor observes them)."""
        self.predictor = system.predictor
        """The system's predictor; `LanePredictors` over it from the first batched step on (`lanes`)."""

    def _note_channel(self, now: float, started: int, twins: int) -> None:
        """Fold the last token's busy share (transfers started, `twins` of them twin reads, times their
        durations, over its duration) into `channel_use`; both managers call it at each token start,
        with the same arithmetic."""
        t, n, w = self._channel_mark
        if now > t:
            busy_s = (started - n - (twins - w)) * self.copy_time_s
            if twins > w:
                busy_s += (twins - w) * self.twin_time_s
            busy = min(1.0, busy_s / (now - t))
            self.channel_use += CHANNEL_WEIGHT * (busy - self.channel_use)
        self._channel_mark = (now, started, twins)

    def _check_weights(self, weights) -> None:
        if weights is None:
            raise UserError("the twin miss path needs each layer's gate weights: the trace or the caller gave none")

    def begin_request(self) -> None:
        """A new request starts: the predictor forgets the request-level history."""
        if self.predictor is not None:
            self.predictor.begin_request()

    def lanes(self) -> LanePredictors | None:
        """The predictor with one state per sequence of a batch (`seqmoe.brain.predict.lanes`), wrapped at
        the first call; None without a predictor."""
        if self.predictor is not None and not isinstance(self.predictor, LanePredictors):
            self.predictor = LanePredictors(self.predictor)
        return self.predictor

    def _forecast(self, step: int):
        """The predictor's forecast after `step` (None: the last one stands), told to `on_forecast`."""
        fc = self.predictor.predict(step)
        if fc is not None and self.on_forecast is not None:
            self.on_forecast(step, fc)
        return fc


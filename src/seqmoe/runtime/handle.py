"""`OffloadRuntime`: the handle `seqmoe.offload` returns: stats, the routing trace, close, restore.

    runtime.stats(); runtime.trace(); runtime.synchronize()
    runtime.close()      # stop managing (threads, hooks); the model keeps reading its slots
    runtime.restore()    # close, then the original experts modules with their weights back

The model holds its runtime (`model._seqmoe_runtime`) while offloaded, so the handle may be
dropped; once neither is reachable a finalizer stops the control and copy threads, which frees the
pool. Teardown (`close`, `restore`) completes even under Ctrl-C: a SIGINT arriving during it is
raised once it is done (`deferred_interrupts`), so the runtime is never left half torn.
What the runtime does between the calls: docs/decode.md.
"""

from __future__ import annotations

import weakref

import torch

from seqmoe.base.errors import UserError
from seqmoe.brain.manager import manager_kind, summarize
from seqmoe.costs.profiles import HardwareProfile, ModelProfile
from seqmoe.runtime.core.experts import OffloadedExperts
from seqmoe.brain.predict.online import forecaster_stats
from seqmoe.runtime.core.signals import deferred_interrupts, shield_off
from seqmoe.trace.schema import RoutingTrace

def _shutdown(thread, worker, host, learner, cache) -> None:
    """Stop the runtime's threads, its online forecaster (`learner`: it keeps what it learned) and its disk
    reads (finalizer: the runtime and its model are gone, or the process exits)."""
    if thread is not None:
        thread.close()
    worker.close()
    if cache is not None:
        cache.close()
    if host is not None:
        host.close()
    if learner is not None:
        learner.close()


VIRTUAL_CLOCK = ("time_s", "tokens_per_s", "stall_s", "time_per_step_s", "full_load_time_s", "full_load_fraction",
                 "copy_time_s", "host_expert_s")
"""The summary's fields on the simulator's clock or cost model: `stats()` names them `sim_*`, beside measured ones."""


class OffloadRuntime:
    """Handle of one offloaded model: stats, the routing trace, restore. Built by `offload`."""

    def __init__(self, model, layers, originals, layouts, kept, pool, worker, controller, hooks, *, system: str,
                 residency: float, start: list[int], model_profile: ModelProfile, hardware: HardwareProfile,
                 expert_dtype: str, host=None, twins=None, learner=None) -> None:
        self.model, self._layers, self._originals, self._layouts = model, layers, originals, layouts
        self._kept = kept  # per layer, the stripped Parameter objects `restore` refills
        self.pool, self.worker, self.controller, self._hooks = pool, worker, controller, hooks
        self.system, self.residency, self.start = system, residency, start
        self.expert_dtype = expert_dtype  # the store's precision, or the model's dtype
        self.capacity = pool.capacity
        self.model_profile, self.hardware = model_profile, hardware
        self.closed = self._restored = False
        self.host = host  # the `HostExecutor`, when misses may be computed on the host CPU
        self.twins = twins  # the `TwinStore` of the twin miss path, or None
        self._finalizer = weakref.finalize(self, _shutdown, controller.thread, worker, host, learner, pool.cache)
        model._seqmoe_runtime = self  # the model keeps its runtime alive while it is offloaded

    @property
    def control(self) -> str:
        """Where the control plane runs: "inline" (in the router hooks) or "thread" (its own thread)."""
        return "inline" if self.controller.thread is None else "thread"

    def _catch_up(self) -> None:
        """The state machine current with every step the model ran (thread mode: waits for the device)."""
        if self.closed:
            return
        self.controller.settle()  # a prompt's replay running aside
        self.controller.abort()  # this thread's forward that was interrupted in a hook, if any
        thread = self.controller.thread
        if thread is not None:
            thread.catch_up()
            if self.pool.device.type == "cuda":
                torch.cuda.synchronize(self.pool.device)  # the device's read counts are final

    def trace(self) -> RoutingTrace:
        """The routing of every position this runtime has served (prompt positions, then each decode step)."""
        if not self.controller.record:
            raise UserError("this runtime keeps no trace: it was offloaded with record_trace=False")
        self._catch_up()
        t = self.controller.trace()
        if t is None:
            raise UserError("the model has not run since offload(); call model.generate(...) first")
        return t

    @property
    def host_s(self) -> float:
        """Seconds the model thread spent orchestrating so far: hooks, control plane, the experts
        wrapper outside the original forward and the gathers (perf_counter)."""
        return self.controller.host_s + sum(e.host_s for e in self._wrappers())

    @property
    def gather_s(self) -> float:
        """Seconds the experts wrappers spent gathering routed rows (slot or host block) into a buffer."""
        return sum(e.gather_s for e in self._wrappers())

    @property
    def miss(self) -> str:
        """How this runtime serves misses (`seqmoe.brain.manager.miss_paths`; its system's, or `offload`'s default)."""
        return self.controller.system.miss

    def _wrappers(self) -> list[OffloadedExperts]:
        return [m.experts for m in self._layers if isinstance(m.experts, OffloadedExperts)]

    def use_lanes(self, lanes: list[int] | None) -> None:
        """The rows of the next forwards are these lanes (a server's batch slots), one per row, so each
        sequence keeps its forecaster state (`seqmoe.brain.predict.lanes`) as other rows come and go;
        None: rows are lanes 0..B-1, as `model.generate` batches them."""
        self.controller.lanes = None if lanes is None else [int(b) for b in lanes]

    def synchronize(self) -> None:
        """Wait until the control plane has seen every step and every queued expert copy has run."""
        self._catch_up()
        self.worker.drain()

    def stats(self) -> dict:
        """The control plane's metrics (the simulator's summary on the virtual clock, every time and speed
        named `sim_*`: `sim_time_s`, `sim_tokens_per_s`, `sim_copies`) and the data plane's counts (`copies`
        and `bytes_copied` really run, reads). A measured speed is the caller's to time (generate prints
        one). Only reads: safe from another thread while the model runs."""
        self._catch_up()
        pool = self.pool
        device_reads = pool.device_reads.tolist()
        pool_reads, host_reads = pool.pool_reads + device_reads[0], pool.host_reads + device_reads[1]
        counts = self.controller.driver.counts()
        eb = pool.expert_bytes
        tokens = counts.num_tokens
        per_token = (lambda s: 1e6 * s / tokens) if tokens else (lambda s: 0.0)
        summary = {(f"sim_{k}" if k in VIRTUAL_CLOCK else k): v for k, v in summarize(counts, expert_bytes=eb).items()}
        if pool.cache is not None:  # the simulated disk tier's counts beside the host cache's real ones
            summary = {(f"sim_{k}" if k.startswith(("disk_", "host_")) else k): v for k, v in summary.items()}
            # a read takes the file's bytes of an expert (more than the row's when rows are quantized as read)
            disk = summary["sim_disk_reads"] * pool.cache.files.expert_nbytes(0, 0)
            summary.update(sim_disk_bytes=disk, sim_disk_bytes_per_token=disk / tokens if tokens else 0.0)
        return {
            "system": self.system, **manager_kind(self.controller.system), "residency": self.residency,
            "capacity": self.capacity, "miss": self.miss,
            "num_layers": pool.num_layers, "num_experts": pool.num_experts, "top_k": self.controller.K,
            "tokens": tokens, "abandoned_tokens": self.controller.abandoned, **summary, "sim_copies": summary["copies"],
            "copies": self.worker.copies, "skipped_copies": self.worker.skipped, "pending_copies": self.worker.pending,
            "bytes_copied": self.worker.copies * eb,
            "control": self.control,
            "pool_reads": pool_reads, "host_reads": host_reads,
            "data_hit_rate": pool_reads / (pool_reads + host_reads) if pool_reads + host_reads else 0.0,
            "peak_gathered_experts": pool.peak_gathered,
            "resident_experts": len(pool.resident()),
            "expert_dtype": self.expert_dtype, "expert_bytes": eb, "device_expert_bytes": pool.device_bytes, "device_expert_bytes_limit": self.capacity * eb,
            "host_expert_bytes": pool.host_bytes,
            "twin": None if self.twins is None else self.twins.layout.precision,
            "twin_reads": 0 if self.twins is None else self.twins.reads + self.twins.posted_reads,
            "host_twin_bytes": 0 if self.twins is None else self.twins.host_bytes,
            "forecaster": forecaster_stats(self.controller.system.predictor),
            "host_us_per_token": per_token(self.host_s),
            "gather_us_per_token": per_token(self.gather_s),
            "device": str(pool.device),
            **(pool.cache.stats(tokens) if pool.cache is not None else {}),
            **({"host_relay_fallbacks": relay.fallbacks} if (relay := self.controller.relay) is not None else {}),
            **(self.controller.routing.stats() if self.controller.routing is not None else {"routing": "exact"}),
        }

    def close(self) -> None:
        """Stop the copy worker and the control thread and remove the hooks; the model keeps its
        offloaded experts but stops being managed (every expert then reads from wherever its table
        entry points; experts streamed from disk are read no more). A control-thread error is raised
        after everything is shut down."""
        if self.closed:
            return
        error = None
        try:
            self._catch_up()  # interruptible: only waits, changes nothing
        except Exception as e:  # the control thread or a replay failed: still shut everything down, then say so
            error = e
        with deferred_interrupts():
            self._stop()
        if error is not None:
            raise error

    def _stop(self) -> None:
        """Hooks off first (the model then no longer drives the threads), then the threads; idempotent."""
        for h in self._hooks:
            h.remove()
        self._finalizer()  # runs `_shutdown` once
        if not self.closed:
            shield_off()
        self.closed = True

    def restore(self) -> None:
        """`close()`, then put the original experts modules back with their weights on the pool's device."""
        if self._restored:
            return
        if self.pool.cache is not None:
            raise UserError("this model's experts stream from its checkpoint on disk and never were in memory: "
                            "restore() cannot give them back; call close(), or load the model whole")
        error = None
        try:
            self.close()
        except RuntimeError as e:
            error = e
        with deferred_interrupts():
            self._stop()
            for m, orig, layout, host, kept in zip(self._layers, self._originals, self._layouts, self.pool.hosts,
                                                   self._kept):
                if m.experts is not orig:
                    layout.unpack(orig, host, self.pool.device, kept)
                    setattr(m.block, m.experts_attr, orig)
            self.model.__dict__.pop("_seqmoe_runtime", None)
            self._restored = True
        if error is not None:
            raise error

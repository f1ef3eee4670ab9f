"""`offload(model, ...)`: run a transformers MoE model with its routed experts in a C-slot device pool.

    runtime = seqmoe.offload(model, residency=0.3, system="on-demand-lru")
    model.generate(input_ids, max_new_tokens=32)      # unchanged transformers usage, batch 1
    runtime.stats(), runtime.trace(), runtime.restore()

What changes on the model instance (transformers' classes and registries are never patched): each
MoE block's `experts` submodule becomes an `OffloadedExperts`, its routed parameters are packed
into host blocks and deleted; forward hooks sit on the model and on each router. Shared experts,
attention and dense layers stay where they were. See `pool` (data plane), `control` (control
plane) and `copier` (the copy worker).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from seqmoe.arch import ExpertLayout, ModelArch, model_arch
from seqmoe.cache import LRUPolicy
from seqmoe.config import DEFAULT_HARDWARE, DEFAULT_RUNTIME_RESIDENCY, DEFAULT_SYSTEM
from seqmoe.errors import UserError
from seqmoe.manager import (SystemInputs, build_manager, build_system, capacity_for, check_dims, start_placement,
                            summarize)
from seqmoe.manager.systems import live_systems, system_spec
from seqmoe.profiles import HardwareProfile, ModelProfile, copy_time_s, get_hardware_profile
from seqmoe.runtime.control import Controller, install_hooks
from seqmoe.runtime.copier import CopyWorker
from seqmoe.runtime.control_thread import ControlThread
from seqmoe.runtime.experts import OffloadedExperts
from seqmoe.runtime.mailbox import Mailbox
from seqmoe.runtime.pool import ExpertPool
from seqmoe.trace.schema import RoutingTrace, TraceMeta


def _check_system(system: str, train: RoutingTrace | None, predictor) -> None:
    choices = ", ".join(live_systems(with_predictor=True))
    spec = system_spec(system, live_systems(with_predictor=True))
    if spec.reads_future:
        raise UserError(f"system {system!r} reads the future of the trace and cannot run live; choose one of: {choices}")
    if spec.needs_predictor and predictor is None:
        raise UserError(f"system {system!r} needs the seq2seq forecaster: pass predictor=DIR (a checkpoint of "
                        "`seqmoe train` on a trace of this model) or a SeqPredictor")
    if spec.learns and train is None:
        raise UserError(f"system {system!r} learns from a routing trace of this model: pass train=RoutingTrace "
                        "(seqmoe.collect.collect_trace), or choose one of: " + ", ".join(live_systems(with_train=False)))


def _load_predictor(predictor, L: int, E: int, K: int):
    """The forecaster object for `predictor` (a checkpoint folder or a `SeqPredictor`), checked against L/E/K."""
    if isinstance(predictor, (str, os.PathLike)):
        from seqmoe.predict.seqmodel import load_seq_predictor

        predictor = load_seq_predictor(predictor)
    if getattr(predictor, "config", None) is not None:
        check_dims("the predictor's training trace", predictor.config, _placeholder_trace(L, E, K, "model"),
                   "train one on a trace of this model (seqmoe train)")
    if not all(callable(getattr(predictor, m, None)) for m in ("check_trace", "begin_request", "begin_token",
                                                                 "observe", "predict")):
        raise UserError(f"predictor= must be a checkpoint folder or a SeqPredictor, got {type(predictor).__name__}")
    return predictor


def _placeholder_trace(L: int, E: int, K: int, name: str) -> RoutingTrace:
    """A one-token trace of shape (L, E, K): what train-free systems and the state machine read dims from."""
    ids = np.broadcast_to(np.arange(K, dtype=np.int16), (1, L, K)).copy()
    return RoutingTrace(expert_ids=ids, request_offsets=np.array([0, 1], np.int64),
                        meta=TraceMeta(model=name, num_experts=E, source="seqmoe.runtime placeholder"))


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def measure_profile(model: torch.nn.Module, arch: ModelArch, layout: ExpertLayout) -> ModelProfile:
    """The cost model's `ModelProfile` of a model whose routed experts are already stripped."""
    layers = arch.moe
    per_layer = [_nbytes(arch.decoder[m.layer_index].parameters()) for m in layers]
    token = _nbytes(model.parameters()) - sum(per_layer)
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (out is None or out.weight is not emb.weight):
        w = emb.weight
        token -= (w.shape[0] - 1) * w[0].numel() * w.element_size()  # a decode token reads one row
    name = getattr(model.config, "model_type", type(model).__name__)
    return ModelProfile(name=f"{name} (measured)", num_layers=len(layers), num_experts=layers[0].num_experts,
                        top_k=layers[0].top_k, expert_bytes=layout.expert_bytes,
                        layer_bytes=int(round(sum(per_layer) / len(per_layer))), token_bytes=max(int(token), 0),
                        source="parameter bytes of the loaded model (seqmoe.runtime)")


class OffloadRuntime:
    """Handle of one offloaded model: stats, the routing trace, restore. Built by `offload`."""

    def __init__(self, model, layers, originals, layouts, pool, worker, controller, hooks, *, system: str,
                 residency: float, start: list[int], model_profile: ModelProfile, hardware: HardwareProfile) -> None:
        self.model, self._layers, self._originals, self._layouts = model, layers, originals, layouts
        self.pool, self.worker, self.controller, self._hooks = pool, worker, controller, hooks
        self.system, self.residency, self.start = system, residency, start
        self.capacity = pool.capacity
        self.model_profile, self.hardware = model_profile, hardware
        self.closed = self._restored = False

    @property
    def control(self) -> str:
        """Where the control plane runs: "inline" (in the router hooks) or "thread" (its own thread)."""
        return "inline" if self.controller.thread is None else "thread"

    def _catch_up(self) -> None:
        """The state machine current with every step the model ran (thread mode: waits for the device)."""
        thread = self.controller.thread
        if thread is not None and not self.closed:
            thread.catch_up()
            if self.pool.device.type == "cuda":
                torch.cuda.synchronize(self.pool.device)
            if not self.controller.posting:
                self.pool.set_idle(True)

    def trace(self) -> RoutingTrace:
        """The routing of every position this runtime has served (prompt positions, then each decode step)."""
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

    def _wrappers(self) -> list[OffloadedExperts]:
        return [m.experts for m in self._layers if isinstance(m.experts, OffloadedExperts)]

    def synchronize(self) -> None:
        """Wait until the control plane has seen every step and every queued expert copy has run."""
        self._catch_up()
        self.worker.drain()

    def stats(self) -> dict:
        """The control plane's metrics (the simulator's summary on the virtual clock: `time_s`,
        `sim_copies`) and the data plane's counts (`copies` and `bytes_copied` really run, reads)."""
        self._catch_up()
        pool = self.pool
        device_reads = pool.device_reads.tolist()
        pool_reads, host_reads = pool.pool_reads + device_reads[0], pool.host_reads + device_reads[1]
        counts = self.controller.driver.counts()
        eb = pool.expert_bytes
        tokens = counts.num_tokens
        per_token = (lambda s: 1e6 * s / tokens) if tokens else (lambda s: 0.0)
        summary = summarize(counts, expert_bytes=eb)
        return {
            "system": self.system, "residency": self.residency, "capacity": self.capacity,
            "num_layers": pool.num_layers, "num_experts": pool.num_experts, "top_k": self.controller.K,
            "tokens": tokens, **summary, "sim_copies": summary["copies"],
            "copies": self.worker.copies, "skipped_copies": self.worker.skipped, "pending_copies": self.worker.pending,
            "bytes_copied": self.worker.copies * eb,
            "control": self.control,
            "pool_reads": pool_reads, "host_reads": host_reads,
            "data_hit_rate": pool_reads / (pool_reads + host_reads) if pool_reads + host_reads else 0.0,
            "peak_gathered_experts": pool.peak_gathered,
            "resident_experts": len(pool.resident()),
            "expert_bytes": eb, "device_expert_bytes": pool.device_bytes, "device_expert_bytes_limit": self.capacity * eb,
            "host_expert_bytes": pool.host_bytes,
            "host_us_per_token": per_token(self.host_s),
            "gather_us_per_token": per_token(self.gather_s),
            "device": str(pool.device),
        }

    def close(self) -> None:
        """Stop the copy worker and remove the hooks; the model keeps its offloaded experts but stops
        being managed (every expert then reads from wherever its table entry points)."""
        if self.closed:
            return
        error = None
        try:
            self._catch_up()
        except RuntimeError as e:  # the control thread failed: still shut everything down, then say so
            error = e
        self.pool.set_idle(True)
        if self.controller.thread is not None:
            self.controller.thread.close()
        self.worker.close()
        for h in self._hooks:
            h.remove()
        self.closed = True
        if error is not None:
            raise error

    def restore(self) -> None:
        """`close()`, then put the original experts modules back with their weights on the pool's device."""
        if self._restored:
            return
        try:
            self.close()
        finally:
            for m, orig, layout, host in zip(self._layers, self._originals, self._layouts, self.pool.hosts):
                layout.unpack(orig, host, self.pool.device)
                setattr(m.block, m.experts_attr, orig)
            self._restored = True


def offload(model, residency: float = DEFAULT_RUNTIME_RESIDENCY, system: str = DEFAULT_SYSTEM, *, device=None, predictor=None,
            bandwidth: float | None = None, train: RoutingTrace | None = None,
            hardware: str | HardwareProfile | None = None, emulate_link: bool = False,
            control: str | None = None) -> OffloadRuntime:
    """Offload the routed experts of `model` (a transformers MoE causal LM) to a pool of C device slots.

    Args:
        model: modified in place (its `experts` submodules, hooks); `runtime.restore()` undoes it.
        residency: r in (0, 1]: C = floor(r x L x E) slots; C must hold one layer's top-k experts.
        system: a live system (`live_systems(with_predictor=True)`): eviction policy + predictor + prefetch scheduler.
        device: where the pool and the rest of the model live (default: the model's device).
        predictor: the seq2seq forecaster of the `seqmoe*` systems: a checkpoint folder (`seqmoe train`
            on a trace of this model) or a `SeqPredictor`; ignored by the other systems. It is fed
            each position's token id (the model's input ids, hashed without a vocabulary).
        bandwidth: host->device bytes/s of the virtual clock's cost model (default: the hardware's).
        train: routing trace of this model for systems that learn (start placement, statistics);
            without it the pool starts empty.
        hardware: hardware profile (preset name, file or object) of the cost model (default `DEFAULT_HARDWARE`).
        emulate_link: the copy worker sleeps one copy time per copy (an emulated link on CPU).
        control: "thread" (default on CUDA): decode steps post their routing to a mailbox and a
            control thread runs the state machine, so a decode step never synchronises with the host
            and can be captured as a CUDA graph (`DecodeGraph`); "inline" (default on the CPU): the
            state machine runs in the router hooks. Same decisions, same counts.
    """
    arch = model_arch(model)
    layers = arch.moe
    L, E, K = len(layers), arch.num_experts, arch.top_k
    C = capacity_for(residency, L, E, K)
    _check_system(system, train, predictor)
    predictor = _load_predictor(predictor, L, E, K) if system_spec(system).needs_predictor else None
    name = str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "model"))
    dims = _placeholder_trace(L, E, K, name)
    if train is not None:
        check_dims("train trace", train, dims, "collect it from this model")
    hw = hardware if isinstance(hardware, HardwareProfile) else get_hardware_profile(hardware or DEFAULT_HARDWARE)
    if bandwidth is not None:
        hw = dataclasses.replace(hw, name=f"{hw.name} at {bandwidth:g} B/s", h2d_bytes_per_s=float(bandwidth))
    start = start_placement(train, C) if train is not None else []
    # `test=dims`: a placeholder without token ids or vocab, so the forecaster hashes the live token
    # ids directly, as simulate() does on the recorded trace (its ids have no vocab either).
    sys_obj = build_system(system, SystemInputs(train=train or dims, test=dims, capacity=C, start=tuple(start),
                                                predictor=predictor))
    if len(start) == L * E:
        # Every expert is resident for good: no prefetch, load or eviction can happen, so the counts
        # are the same without the forecaster and the scheduler, and with any eviction policy (LRU's
        # bookkeeping is the cheapest); skip their per-layer work.
        sys_obj = dataclasses.replace(sys_obj, policy=LRUPolicy(), predictor=None, prefetcher=None)
    originals = []
    for m in layers:
        experts = m.experts
        if isinstance(experts, OffloadedExperts):
            raise UserError("this model is already offloaded; call runtime.restore() first")
        if not isinstance(experts, torch.nn.Module):
            raise UserError(f"MoE block {type(m.block).__name__} has no `{m.experts_attr}` module; not supported by "
                            "the runtime")
        originals.append(experts)
    layouts = [arch.layout(x) for x in originals]
    if len(set(layouts)) > 1:
        raise UserError("MoE layers differ in expert shapes; the runtime needs one expert size")
    layout = layouts[0]
    model_device = next(p.device for p in originals[0].parameters())
    device = torch.device(device) if device is not None else model_device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device} was asked for but CUDA is not available; pass device='cpu' or None")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    control = control or ("thread" if device.type == "cuda" else "inline")
    if control not in ("inline", "thread"):
        raise UserError(f"control must be 'inline' or 'thread', got {control!r}")
    hosts = []
    for x in originals:  # layer by layer: at most one layer's experts exist twice at a time
        host = torch.empty((E, layout.numel), dtype=layout.dtype, pin_memory=device.type == "cuda")
        layout.pack(x, host)
        layout.strip(x)
        hosts.append(host)
    if model_device != device:
        model.to(device)  # the dense remainder only: the routed experts are already out
    mp = measure_profile(model, arch, layout)
    pool = ExpertPool(hosts, C, device)
    for uid in start:
        pool.load_now(uid)
    meta = TraceMeta(model=name, num_experts=E, source=f"seqmoe.runtime ({system}, residency {residency})",
                     extra={"architecture": getattr(model.config, "model_type", "unknown"), "family": arch.family.name,
                            "moe_layers": [m.layer_index for m in layers], "mode": "runtime",
                            "system": system, "capacity": C})
    controller = Controller(sys_obj, L, E, K, meta)
    manager = build_manager(sys_obj, model=mp, hardware=hw, capacity=C, start=start, observer=controller)
    worker = CopyWorker(pool, copy_time_s(mp, hw) if emulate_link else None)
    controller.attach(manager, pool, worker)
    if control == "thread":
        controller.mailbox = Mailbox(L, K, device)
        controller.thread = ControlThread(controller, controller.mailbox, controller.lock)
        pool.fence = lambda: controller.mailbox.progress
    for l, (m, orig) in enumerate(zip(layers, originals)):
        setattr(m.block, m.experts_attr, OffloadedExperts(orig, l, layout, pool, controller))
    hooks = install_hooks(controller, model, [m.router for m in layers])
    return OffloadRuntime(model, layers, originals, layouts, pool, worker, controller, hooks, system=system,
                          residency=residency, start=start, model_profile=mp, hardware=hw)

"""`offload(model, ...)`: run a transformers MoE model with its routed experts in a C-slot device pool.

    runtime = seqmoe.offload(model, residency=0.3, system="on-demand-lru")
    model.generate(input_ids, max_new_tokens=32)      # unchanged transformers usage, batch 1
    runtime.stats(), runtime.trace(), runtime.restore()

What changes on the model instance (transformers' classes and registries are never patched): each
MoE block's `experts` submodule becomes an `OffloadedExperts`, its routed parameters are packed
into host blocks and taken out (emptied, kept for `restore`); forward hooks and a forward guard sit
on the model and on each router. Shared experts, attention and dense layers stay where they were
(or move to `device`). See `pool` (data plane), `control` (control plane) and `copier`.

`offload` is all-or-nothing: every argument and the device's free memory are checked before
anything changes, and each change after that is undone, in reverse, if a later step fails (an
out-of-memory pool, a failing copy, Ctrl-C): the model is then as it was, weights, devices and
Parameter objects alike.
"""

from __future__ import annotations

import dataclasses
import numbers
import os

import numpy as np
import torch

from seqmoe.arch import ExpertLayout, ModelArch, model_arch
from seqmoe.cache import LRUPolicy
from seqmoe.config import DEFAULT_HARDWARE, DEFAULT_RUNTIME_MISS, DEFAULT_RUNTIME_RESIDENCY, DEFAULT_SYSTEM
from seqmoe.errors import UserError
from seqmoe.host_cost import has_host_path, host_expert_time_s
from seqmoe.manager import SystemInputs, build_manager, build_system, capacity_for, start_placement
from seqmoe.manager.miss_paths import check_miss
from seqmoe.manager.systems import live_systems, system_spec
from seqmoe.profiles import HardwareProfile, ModelProfile, copy_time_s, get_hardware_profile
from seqmoe.runtime.core.device import Undo, allocate_slots, check_device_memory, move_model, resolve_device
from seqmoe.rerouting import CacheAwareRouting, check_routing
from seqmoe.runtime.eager.host_exec import HostExecutor
from seqmoe.runtime.posted.host_relay import HostRelay
from seqmoe.runtime.core.controller import Controller
from seqmoe.runtime.posted.control_thread import ControlThread
from seqmoe.runtime.core.copier import CopyWorker
from seqmoe.runtime.core.costs import MEASURED, measure_host_expert_s, measure_link, measured_profile
from seqmoe.runtime.core.experts import OffloadedExperts
from seqmoe.runtime.posted.fence import ReadFence
from seqmoe.runtime.handle import OffloadRuntime
from seqmoe.runtime.eager.hooks import install_hooks
from seqmoe.runtime.posted.mailbox import Mailbox
from seqmoe.runtime.core.pool import ExpertPool
from seqmoe.runtime.kernels import relay as relay_kernels
from seqmoe.runtime.eager.pregate import LivePregate
from seqmoe.runtime.kernels.rerouting import DeviceCacheRouting
from seqmoe.predict.pregate import HybridPredictor, PregatePredictor
from seqmoe.runtime.core.signals import shield_off, shield_on
from seqmoe.trace.schema import RoutingTrace, TraceMeta, check_dims

__all__ = ["offload", "OffloadRuntime", "measure_profile"]


_LIVE = dict(with_predictor=True, with_host=True, with_pregate=True)
"""What `offload` can run live: every system that reads no future."""


def _check_system(system: str, train: RoutingTrace | None, predictor, replay: RoutingTrace | None) -> None:
    choices = ", ".join(live_systems(**_LIVE))
    spec = system_spec(system, None if replay is not None else live_systems(**_LIVE))
    if spec.reads_future and replay is None:
        raise UserError(f"system {system!r} reads the future of the trace and cannot run live; choose one of: {choices}")
    if spec.needs_predictor and predictor is None:
        raise UserError(f"system {system!r} needs the seq2seq forecaster: pass predictor=DIR (a checkpoint of "
                        "`seqmoe train` on a trace of this model) or a SeqPredictor")
    if spec.learns and train is None:
        raise UserError(f"system {system!r} learns from a routing trace of this model: pass train=RoutingTrace "
                        "(seqmoe.collect.collect_trace), or choose one of: " + ", ".join(live_systems(with_train=False)))
    if spec.needs_pregate and (train is None or train.pregate_logits is None):
        raise UserError(f"system {system!r} fuses pre-gating: pass a train= trace collected with pre-gate scores "
                        "(seqmoe trace collect --pregate H), whose fusion weights it fits")


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
    """The cost model's `ModelProfile` of `model`, whose routed experts may be stripped already
    (their parameters are left out either way)."""
    layers = arch.moe
    routed = [_nbytes(m.experts.parameters()) for m in layers]
    per_layer = [_nbytes(arch.decoder[m.layer_index].parameters()) - r for m, r in zip(layers, routed)]
    token = _nbytes(model.parameters()) - sum(routed) - sum(per_layer)
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (out is None or out.weight is not emb.weight):
        w = emb.weight
        token -= (w.shape[0] - 1) * w[0].numel() * w.element_size()  # a decode token reads one row
    name = getattr(model.config, "model_type", type(model).__name__)
    return ModelProfile(name=f"{name} (measured)", num_layers=len(layers), num_experts=layers[0].num_experts,
                        top_k=layers[0].top_k, expert_bytes=layout.expert_bytes,
                        layer_bytes=int(round(sum(per_layer) / len(per_layer))), token_bytes=max(int(token), 0),
                        source="parameter bytes of the loaded model (seqmoe.runtime)")


def offload(model, residency: float = DEFAULT_RUNTIME_RESIDENCY, system: str = DEFAULT_SYSTEM, *, device=None, predictor=None,
            bandwidth: float | None = None, train: RoutingTrace | None = None,
            hardware: str | HardwareProfile | None = None, emulate_link: bool = False,
            control: str | None = None, replay: RoutingTrace | None = None, routing: str = "exact",
            max_kl: float | None = None, miss: str | None = None, record_trace: bool = True) -> OffloadRuntime:
    """Offload the routed experts of `model` (a transformers MoE causal LM) to a pool of C device slots.

    Args:
        model: modified in place (its `experts` submodules, hooks); `runtime.restore()` undoes it.
        residency: r in (0, 1]: C = floor(r x L x E) slots; C must hold one layer's top-k experts.
        system: a live system (`live_systems(**_LIVE)`): eviction policy + predictor + prefetch scheduler.
        device: where the pool and the rest of the model live (default: the model's device).
        predictor: the seq2seq forecaster of the `seqmoe*` systems: a checkpoint folder (`seqmoe train`
            on a trace of this model) or a `SeqPredictor`; ignored by the other systems. It is fed
            each position's token id (the model's input ids, hashed without a vocabulary).
        bandwidth: host->device bytes/s of the virtual clock's cost model (default: the hardware's).
        train: routing trace of this model for systems that learn (start placement, statistics);
            without it the pool starts empty.
        hardware: hardware profile (preset name, file or object) of the cost model, or "measured":
            `DEFAULT_HARDWARE` with its link and host CPU measured on this machine at start
            (`costs`). Default: "measured" when misses may go to the host CPU (`miss` "cpu" or
            "auto", `cpu-all`, `static-split-style`: choosing a path needs this machine's costs),
            else `DEFAULT_HARDWARE`.
        emulate_link: CPU only: every expert row crossing the link costs one copy time of the cost
            model (copies and in-place reads; a miss waits for its copy), see `pool`; it needs a
            profile, not "measured".
        control: "thread" (default on CUDA): decode steps post their routing to a mailbox and a
            control thread runs the state machine, so a decode step never synchronises with the host
            and can be captured as a CUDA graph (`DecodeGraph`); "inline" (default on the CPU): the
            state machine runs in the router hooks. Same decisions, same counts.
        replay: the routing this model will compute, position for position, when a harness forces
            it (`realsize.ForcedRouting`): the forecaster hashes its tokens through the trace's
            vocabulary as the simulator does, and the oracle systems may read its future.
        routing: "exact" (default) or "cache-aware": a missing routed expert may be swapped for a
            resident one the router scored close to it, each token spending at most `max_kl`
            nats of KL divergence from the router's distribution (`cache_routing`; posted steps
            on CUDA apply it in a kernel, `kernels.rerouting`).
        miss: how a miss is served (`seqmoe.manager.miss_paths`): "copy" into a slot, "in-place"
            (read from its host row, no slot), "cpu" (computed on the host CPU by
            `host_exec.HostExecutor` while the device computes the rest; with control="thread"
            through `host_relay`; on CUDA that needs triton) or "auto" (chosen per miss from the cost
            model's link and host, measured by default). Default: `DEFAULT_RUNTIME_MISS` with
            inline control, "copy" with control="thread". Systems that fix their own path
            (`cpu-all`, `static-split-style`) ignore it.
        record_trace: keep every position's routing for `runtime.trace()`; it grows by L x K x 6 bytes
            and a few small arrays per position, so a long-running server (`seqmoe serve`) turns it off.
    """
    check_routing(routing, max_kl)
    if miss is not None:
        check_miss(miss)
    plan = _plan(model, residency, system, device=device, predictor=predictor, bandwidth=bandwidth, train=train,
                 hardware=hardware, control=control, replay=replay, miss=miss, emulate_link=emulate_link)
    if plan.control == "thread" and plan.device.type == "cuda" and not relay_kernels.available():
        needs = [f"miss={plan.system.miss!r}"] if _on_host_cpu(plan.system) else []
        needs += ["cache-aware routing"] if routing != "exact" else []
        if needs:
            raise UserError(f"{' and '.join(needs)} with control='thread' on CUDA run(s) in Triton kernels, and no "
                            "triton with tl.atomic_load is installed: pip install -U triton, or use control='inline'")
    return _assemble(model, plan, emulate_link, max_kl if routing != "exact" else None, record_trace)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything `offload` decided before changing the model."""

    arch: ModelArch
    originals: list
    layouts: list
    device: torch.device
    control: str
    capacity: int
    system: object
    start: list
    hardware: HardwareProfile
    measure: bool
    """The link and host fields of `hardware` are to be measured at start (`costs`)."""
    meta: TraceMeta
    system_name: str
    residency: float
    pregate: LivePregate | None
    """The live pre-gate rows the system reads (the router hooks note their inputs), or None."""


def _plan(model, residency, system, *, device, predictor, bandwidth, train, hardware, control, replay,
          miss=None, emulate_link=False) -> _Plan:
    """Check every argument and the device's free memory; UserError before anything changes."""
    if isinstance(residency, bool) or not isinstance(residency, numbers.Real):
        raise UserError(f"residency must be a number in (0, 1], got {residency!r} ({type(residency).__name__})")
    arch = model_arch(model)
    layers = arch.moe
    L, E, K = len(layers), arch.num_experts, arch.top_k
    C = capacity_for(float(residency), L, E, K)
    _check_system(system, train, predictor, replay)
    predictor = _load_predictor(predictor, L, E, K) if system_spec(system).needs_predictor else None
    name = str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "model"))
    dims = _placeholder_trace(L, E, K, name)
    if train is not None:
        check_dims("train trace", train, dims, "collect it from this model")
    if replay is not None:
        check_dims("replay trace", replay, dims, "record it from this architecture")
    start = start_placement(train, C) if train is not None else []
    originals = _experts_modules(layers)
    layouts = [arch.layout(x) for x in originals]
    if len(set(layouts)) > 1:
        raise UserError("MoE layers differ in expert shapes; the runtime needs one expert size")
    device = resolve_device(device, next(p.device for p in originals[0].parameters()))
    control = control or ("thread" if device.type == "cuda" else "inline")
    if control not in ("inline", "thread"):
        raise UserError(f"control must be 'inline' or 'thread', got {control!r}")
    miss = miss or (DEFAULT_RUNTIME_MISS if control == "inline" else "copy")
    if device.type == "cuda":
        check_device_memory(model, originals, device, C, layouts[0].expert_bytes, L * E)
    # `test=dims`: a placeholder without token ids or vocab, so the forecaster hashes the live token
    # ids directly, as simulate() does on the recorded trace (its ids have no vocab either).
    # Pre-gate rows computed live, for the systems that fuse them (their weights fitted on `train`'s).
    pregate = None if train is None or train.pregate_logits is None else LivePregate(
        [m.router for m in layers], train.pregate_logits.shape[2], E, K)
    sys_obj = build_system(system, SystemInputs(train=train or dims, test=replay or dims, capacity=C, start=tuple(start),
                                                predictor=predictor, pregate=pregate), miss)
    measure = hardware == MEASURED or (hardware is None and _on_host_cpu(sys_obj))
    if measure and (bandwidth is not None or emulate_link):
        raise UserError("a measured cost model takes its link from this machine: give hardware= a profile to use "
                        "bandwidth= or emulate_link=")
    hw = hardware if isinstance(hardware, HardwareProfile) else get_hardware_profile(
        DEFAULT_HARDWARE if measure or hardware is None else hardware)
    if bandwidth is not None:
        hw = dataclasses.replace(hw, name=f"{hw.name} at {bandwidth:g} B/s", h2d_bytes_per_s=float(bandwidth))
    if len(start) == L * E:
        # Every expert is resident for good: no prefetch, load or eviction can happen, so the counts
        # are the same without the forecaster and the scheduler, and with any eviction policy (LRU's
        # bookkeeping is the cheapest); skip their per-layer work.
        sys_obj = dataclasses.replace(sys_obj, policy=LRUPolicy(), predictor=None, prefetcher=None)
    if not isinstance(sys_obj.predictor, (HybridPredictor, PregatePredictor)):
        pregate = None  # nothing reads it: the router hooks keep no input
    elif control != "inline":
        raise UserError(f"system {system!r} fuses pre-gating, computed from the live hidden states: it runs with "
                        "control='inline'")
    meta = TraceMeta(model=name, num_experts=E, source=f"seqmoe.runtime ({system}, residency {residency})",
                     extra={"architecture": getattr(model.config, "model_type", "unknown"), "family": arch.family.name,
                            "moe_layers": [m.layer_index for m in layers], "mode": "runtime",
                            "system": system, "capacity": C})
    return _Plan(arch, originals, layouts, device, control, C, sys_obj, start, hw, measure, meta, system, residency,
                 pregate)


def _on_host_cpu(system) -> bool:
    """`system` may compute experts on the host CPU."""
    return system.miss in ("cpu", "auto") or system.host_only


def _measured(hw: HardwareProfile, model, plan: _Plan, hosts, host: HostExecutor | None) -> HardwareProfile:
    """`hw` with the link and host CPU of this machine (`costs`), measured with the runtime's own
    operations (a host executor made for the measurement when the runtime has none)."""
    layout, own = plan.layouts[0], host
    host = host or HostExecutor()
    try:
        twin = HostExecutor.twin(plan.originals[0])
        host_s = measure_host_expert_s(host, twin, layout, hosts[0], model.config.hidden_size, plan.arch.top_k,
                                       plan.device)
    finally:
        if own is None:
            host.close()
    return measured_profile(hw, layout.expert_bytes, measure_link(hosts[0][0], plan.device), host_s)


def _assemble(model, plan: _Plan, emulate_link: bool, max_kl: float | None, record_trace: bool) -> OffloadRuntime:
    """Change the model as `plan` says; every step is undone, in reverse, if a later one fails."""
    arch, originals, layout, device = plan.arch, plan.originals, plan.layouts[0], plan.device
    layers, C, hw = arch.moe, plan.capacity, plan.hardware
    L, E, K = len(layers), arch.num_experts, arch.top_k
    with Undo() as undo:
        hosts, kept = _pack(originals, layout, device, undo)
        move_model(model, device, undo)  # the dense remainder only: the routed experts are already out
        mp = measure_profile(model, arch, layout)
        fence = ReadFence(device) if plan.control == "thread" else None
        pool = ExpertPool(hosts, C, device, slots=allocate_slots(C, layout, device, L * E), fence=fence,
                          link_s=copy_time_s(mp, hw) if emulate_link else None)
        for uid in plan.start:
            pool.load_now(uid)
        host = None
        if _on_host_cpu(plan.system) and (plan.measure or has_host_path(hw)):
            host = HostExecutor(host_expert_time_s(mp, hw) if emulate_link else 0.0)
            undo.push(host.close)
        if plan.measure:
            hw = _measured(hw, model, plan, hosts, host)
        controller = Controller(plan.system, L, E, K, plan.meta, record=record_trace)
        controller.pregate = plan.pregate
        manager = build_manager(plan.system, model=mp, hardware=hw, capacity=C, start=plan.start, observer=controller)
        worker = CopyWorker(pool)
        undo.push(worker.close)
        controller.attach(manager, pool, worker)
        if max_kl is not None:
            controller.routing = CacheAwareRouting(max_kl, missing=pool.missing_row, resident=lambda l: pool.table_host[l] >= 0)
            if plan.control == "thread" and device.type == "cuda":  # posted steps substitute on the device
                controller.routing.posted = DeviceCacheRouting(max_kl, pool, K)
        if plan.control == "thread":
            controller.fence = fence
            controller.mailbox = Mailbox(L, K, device, fence)
            if host is not None:
                twins = [HostExecutor.twin(x) for x in originals]
                controller.relay = HostRelay(controller.mailbox, model.config.hidden_size, layout.dtype, host, twins,
                                             layout, hosts, control_failed=lambda: controller.thread.stopped,
                                             device=device)
            controller.thread = ControlThread(controller, controller.mailbox, controller.lock,
                                              on_stop=controller.relay.abort if controller.relay is not None else None)
            undo.push(controller.thread.close)
        for l, (m, orig) in enumerate(zip(layers, originals)):
            setattr(m.block, m.experts_attr, OffloadedExperts(orig, l, layout, pool, controller, host))
            undo.push(lambda m=m, orig=orig: setattr(m.block, m.experts_attr, orig))
        hooks = install_hooks(controller, model, [m.router for m in layers])
        undo.push(lambda: [h.remove() for h in hooks])
        shield_on()  # Ctrl-C now waits for the end of a state-machine transition (`signals`)
        undo.push(shield_off)
        return OffloadRuntime(model, layers, originals, plan.layouts, kept, pool, worker, controller, hooks,
                              system=plan.system_name, residency=plan.residency, start=plan.start, model_profile=mp,
                              hardware=hw, host=host)


def _experts_modules(layers) -> list[torch.nn.Module]:
    """Each MoE layer's routed experts module; UserError if the model is offloaded already or has none."""
    originals = []
    for m in layers:
        experts = m.experts
        if isinstance(experts, OffloadedExperts):
            raise UserError("this model is already offloaded; call runtime.restore() first")
        if not isinstance(experts, torch.nn.Module):
            raise UserError(f"MoE block {type(m.block).__name__} has no `{m.experts_attr}` module; not supported by "
                            "the runtime")
        originals.append(experts)
    return originals


def _pack(originals, layout: ExpertLayout, device: torch.device, undo: Undo):
    """(host blocks [E, P] per layer, stripped Parameters per layer): layer by layer, so at most one
    layer's experts exist twice at a time; each layer is given its weights back if a later step fails."""
    hosts, kept = [], []
    for x in originals:
        E = x.num_experts
        home = next(x.parameters()).device
        host = torch.empty((E, layout.numel), dtype=layout.dtype, pin_memory=device.type == "cuda")
        layout.pack(x, host)
        params = layout.strip(x)
        undo.push(lambda x=x, host=host, params=params, home=home: layout.unpack(x, host, home, params))
        hosts.append(host)
        kept.append(params)
    return hosts, kept

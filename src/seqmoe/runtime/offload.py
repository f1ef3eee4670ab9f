"""`offload(model, ...)`: run a transformers MoE model with its routed experts in a C-slot device pool.

    runtime = seqmoe.offload(model, residency=0.3, system="on-demand-lru")
    model.generate(input_ids, max_new_tokens=32)      # unchanged transformers usage, batch 1
    runtime.stats(), runtime.trace(), runtime.restore()

What changes on the model instance (transformers' classes and registries are never patched): each
MoE block's `experts` submodule becomes an `OffloadedExperts`, its routed parameters are packed
into host blocks and taken out (emptied, kept for `restore`); forward hooks and a forward guard sit
on the model and on each router. Shared experts, attention and dense layers stay where they were
(or move to `device`).

Every option is a field of `seqmoe.config.OffloadConfig`, checked when it is built. `offload` is
all-or-nothing: the options, the model and the device's free memory are checked before anything
changes (`_plan`), and each change after that is undone, in reverse, if a later step fails (an
out-of-memory pool, a failing copy, Ctrl-C): the model is then as it was, weights, devices and
Parameter objects alike. docs/decode.md tells what the parts built here do in a decode step.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch

from seqmoe.arch import ExpertLayout, ModelArch, model_arch
from seqmoe.arch.quant import QuantLayout, store_layout
from seqmoe.brain.policies import LRUPolicy
from seqmoe.config import DEFAULT_HARDWARE, DEFAULT_RESIDENCY, MEASURED, OffloadConfig
from seqmoe.base.errors import UserError
from seqmoe.costs.host_cost import has_host_path, host_expert_time_s, prompt_costs
from seqmoe.brain.manager import SystemInputs, build_manager, build_system, capacity_for, start_placement
from seqmoe.brain.manager.miss_paths import check_twin, miss_rule
from seqmoe.brain.manager.placement import capacity_for_bytes
from seqmoe.brain.manager.systems import system_spec
from seqmoe.costs.profiles import HardwareProfile, ModelProfile, copy_time_s, get_hardware_profile
from seqmoe.costs.precision import format_bytes, parse_bytes
from seqmoe.runtime.core.device import (
    Undo, allocate_slots, check_device_memory, dense_bytes, move_model, pool_room, resolve_device,
)
from seqmoe.brain.rerouting import CacheAwareRouting
from seqmoe.runtime.eager.experts import eager_forward
from seqmoe.runtime.eager.host_exec import HostExecutor
from seqmoe.runtime.posted.experts import posted_forward
from seqmoe.runtime.posted.host_relay import HostRelay
from seqmoe.runtime.core.controller import Controller
from seqmoe.runtime.posted.steps import PostedController
from seqmoe.runtime.core.copier import CopyWorker
from seqmoe.runtime.core.costs import measure_host_expert_s, measure_link, measured_profile
from seqmoe.runtime.core.experts import OffloadedExperts
from seqmoe.runtime.posted.fence import ReadFence
from seqmoe.runtime.handle import OffloadRuntime
from seqmoe.runtime.eager.hooks import install_hooks
from seqmoe.runtime.posted.mailbox import MAX_ROWS, Mailbox
from seqmoe.runtime.core.pool import ExpertPool
from seqmoe.runtime.kernels import relay as relay_kernels
from seqmoe.runtime.eager.pregate import LivePregate
from seqmoe.runtime.eager.twins import TwinStore
from seqmoe.runtime.kernels.rerouting import DeviceCacheRouting
from seqmoe.brain.predict.learner import ProcessLearner
from seqmoe.brain.predict.online import NoLearner, OnlineForecaster
from seqmoe.runtime.forecasters import given_forecaster, online_forecaster_for
from seqmoe.runtime.disk.plan import DiskPlan, plan_disk
from seqmoe.brain.predict.pregate import HybridPredictor, PregatePredictor
from seqmoe.runtime.core.signals import shield_off, shield_on
from seqmoe.trace.io import load_trace
from seqmoe.trace.schema import RoutingTrace, TraceMeta, check_dims, placeholder_trace

__all__ = ["offload", "OffloadRuntime", "measure_profile"]


def _trace(value, what: str) -> RoutingTrace | None:
    """`value` as a RoutingTrace: loaded when it is a path."""
    if value is None or isinstance(value, RoutingTrace):
        return value
    if isinstance(value, (str, os.PathLike)):
        return load_trace(value)
    raise UserError(f"{what}= must be a RoutingTrace or a trace file, got {type(value).__name__}")


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
                        expert_params=getattr(layout, "base", layout).numel,
                        layer_bytes=int(round(sum(per_layer) / len(per_layer))), token_bytes=max(int(token), 0),
                        source="parameter bytes of the loaded model (seqmoe.runtime)")


_GIVEN = object()
"""`offload`'s residency and system when not given: the config's (or its defaults) stand."""


def offload(model, residency: float = _GIVEN, system: str = _GIVEN, *, config: OffloadConfig | None = None,
            source=None, **options) -> OffloadRuntime:
    """Offload the routed experts of `model` (a transformers MoE causal LM) to a pool of C device slots.

    Args:
        model: modified in place (its `experts` submodules, hooks); `runtime.restore()` undoes it.
        residency, system: `OffloadConfig.residency` and `.system`, the two options most runs set.
        config: every option, with its default (`seqmoe.config.OffloadConfig`; each field's docstring
            says what it does).
        source: the checkpoint the routed experts stream from (`seqmoe.runtime.disk.checkpoint.ExpertFiles`;
            `seqmoe.load` passes it for a model whose experts were never read), or None: from memory.
        **options: fields of the configuration to set, e.g. `miss="auto"`, `control="thread"`,
            `train=trace`, `predictor="ckpt/"`, `hardware="measured"`, `routing="cache-aware", max_kl=0.02`.
    """
    given = {k: v for k, v in (("residency", residency), ("system", system)) if v is not _GIVEN} | options
    cfg = dataclasses.replace(config, **given) if config is not None else OffloadConfig(**given)
    plan = _plan(model, cfg, source)
    return _assemble(model, plan, cfg)


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
    pregate: LivePregate | None
    """The live pre-gate rows the system reads (the router hooks note their inputs), or None."""
    online: Path | None
    """Where the forecaster learned online is kept (`predict.checkpoints.online_dir`), or None: none is learned."""
    disk: DiskPlan | None = None
    """The disk tier (experts streamed from the checkpoint), or None: every expert in host memory."""


def _plan(model, cfg: OffloadConfig, source=None) -> _Plan:
    """What `cfg` means for `model`: its traces and forecaster loaded, the model and the device's free
    memory checked; UserError before anything changes."""
    arch = model_arch(model)
    layers = arch.moe
    L, E, K = len(layers), arch.num_experts, arch.top_k
    spec = system_spec(cfg.system)
    name = str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "model"))
    dims = placeholder_trace(L, E, K, name)
    train, replay = _trace(cfg.train, "train"), _trace(cfg.replay, "replay")
    if train is not None:
        check_dims("train trace", train, dims, "collect it from this model")
    if replay is not None:
        check_dims("replay trace", replay, dims, "record it from this architecture")
    if spec.needs_pregate and train.pregate_logits is None:
        raise UserError(f"system {cfg.system!r} fuses pre-gating: give a train trace collected with pre-gate scores "
                        "(seqmoe trace collect --pregate H), whose fusion weights it fits")
    originals = _experts_modules(layers)
    layouts = [arch.layout(x) for x in originals]
    if len(set(layouts)) > 1:
        raise UserError("MoE layers differ in expert shapes; the runtime needs one expert size")
    if cfg.expert_dtype is not None:
        layouts = [store_layout(x, cfg.expert_dtype) for x in layouts]
    home = next(p.device for p in originals[0].parameters())
    device = resolve_device(cfg.device, torch.device("cpu") if home.type == "meta" else home)  # meta: on disk
    control = cfg.control_on(device.type)
    C = _capacity(cfg, model, originals, device, layouts[0].expert_bytes, L, E, K)
    on_host = dense_bytes(model, originals) + C * layouts[0].expert_bytes if device.type == "cpu" else 0
    disk = plan_disk(source, cfg, layouts[0], L, E, K, others=on_host)  # the host cache beside them
    if device.type == "cuda":
        check_device_memory(model, originals, device, C, layouts[0].expert_bytes, L * E)
    start = start_placement(train, C) if train is not None else []
    predictor, prior, online = None, None, None
    if spec.needs_predictor and cfg.predictor is None and not spec.needs_pregate:
        predictor, prior, online = online_forecaster_for(model, originals, L, E, K,
                                                         None if disk is None else disk.first_expert)
        if train is None:  # what the cached forecaster saw sets the start placement
            start = [int(u) for u in np.argsort(-prior[0], kind="stable")[:C]] if predictor.source == "cache" else []
        else:
            prior = None
    elif spec.needs_predictor:
        predictor = given_forecaster(cfg.predictor, L, E, K)
    # `test=dims`: a placeholder without token ids or vocab, so the forecaster hashes the live token
    # ids directly, as simulate() does on the recorded trace (its ids have no vocab either).
    # Pre-gate rows computed live, for the systems that fuse them (their weights fitted on `train`'s).
    pregate = None if train is None or train.pregate_logits is None else LivePregate(
        [m.router for m in layers], train.pregate_logits.shape[2], E, K)
    sys_obj = build_system(cfg.system, SystemInputs(train=train or dims, test=replay or dims, capacity=C,
                                                    start=tuple(start), predictor=predictor, pregate=pregate,
                                                    prior=prior, draft=cfg.draft),
                           cfg.miss_with(control), check_twin(cfg.twin, cfg.twin_budget))
    measure = cfg.hardware == MEASURED or (cfg.hardware is None and _on_host_cpu(sys_obj))
    if measure and (cfg.bandwidth is not None or cfg.emulate_link):
        raise UserError(f"a measured cost model takes its link from this machine (system {cfg.system!r} with miss "
                        f"{sys_obj.miss!r} prices its host path with one): give a hardware profile to use a bandwidth "
                        "or an emulated link")
    hw = cfg.hardware if isinstance(cfg.hardware, HardwareProfile) else get_hardware_profile(
        DEFAULT_HARDWARE if measure or cfg.hardware is None else cfg.hardware)
    if cfg.bandwidth is not None:
        hw = dataclasses.replace(hw, name=f"{hw.name} at {cfg.bandwidth:g} B/s", h2d_bytes_per_s=float(cfg.bandwidth))
    if len(start) == L * E:
        # Every expert is resident for good: no prefetch, load or eviction can happen, so the counts
        # are the same without the forecaster and the scheduler, and with any eviction policy (LRU's
        # bookkeeping is the cheapest); skip their per-layer work.
        sys_obj = dataclasses.replace(sys_obj, policy=LRUPolicy(), predictor=None, prefetcher=None, twin=None)
    if not isinstance(sys_obj.predictor, (HybridPredictor, PregatePredictor)):
        pregate = None  # nothing reads it: the router hooks keep no input
    elif control != "inline":
        raise UserError(f"system {cfg.system!r} fuses pre-gating, computed from the live hidden states: it runs with "
                        "control='inline'")
    if control == "thread" and device.type == "cuda" and not relay_kernels.available():
        needs = [f"miss={sys_obj.miss!r}"] if _on_host_cpu(sys_obj) else []
        needs += ["cache-aware routing"] if cfg.routing != "exact" else []
        if needs:
            raise UserError(f"{' and '.join(needs)} with control='thread' on CUDA run(s) in Triton kernels, and no "
                            "triton with tl.atomic_load is installed: pip install -U triton, or use control='inline'")
    meta = TraceMeta(model=name, num_experts=E, source=f"seqmoe.runtime ({cfg.system}, {C} slots of {L * E} experts)",
                     extra={"architecture": getattr(model.config, "model_type", "unknown"), "family": arch.family.name,
                            "moe_layers": [m.layer_index for m in layers], "mode": "runtime",
                            "system": cfg.system, "capacity": C})
    return _Plan(arch, originals, layouts, device, control, C, sys_obj, start, hw, measure, meta, pregate, online, disk)


def _capacity(cfg: OffloadConfig, model, originals, device: torch.device, expert_bytes: int, L: int, E: int,
              K: int) -> int:
    """C: from the residency, else from the expert memory budget, else (CUDA) what fits the free
    memory, else from the default residency; UserError when C cannot hold one layer's K experts."""
    if cfg.residency is not None:
        return capacity_for(cfg.residency, L, E, K)
    if cfg.expert_memory is None and device.type != "cuda":
        return capacity_for(DEFAULT_RESIDENCY, L, E, K)
    if cfg.expert_memory is not None:
        budget = parse_bytes(cfg.expert_memory, "expert_memory")
        return capacity_for_bytes(budget, expert_bytes, L, E, K, f"expert_memory {format_bytes(budget)}")
    return capacity_for_bytes(pool_room(model, originals, device), expert_bytes, L, E, K,
                              f"the free memory of {device}")


def _on_host_cpu(system) -> bool:
    """`system` may compute experts on the host CPU."""
    return miss_rule(system.miss).may_use_host_cpu or system.host_only


def _measured(hw: HardwareProfile, model, plan: _Plan, hosts, host: HostExecutor | None) -> HardwareProfile:
    """`hw` with the link and host CPU of this machine (`costs`), measured with the runtime's own
    operations (a host executor made for the measurement when the runtime has none)."""
    layout, own = plan.layouts[0], host
    host = host or HostExecutor()
    try:
        clone = HostExecutor.clone(plan.originals[0])
        host_s = measure_host_expert_s(host, clone, layout, hosts[0], model.config.hidden_size, plan.arch.top_k,
                                       plan.device)
    finally:
        if own is None:
            host.close()
    return measured_profile(hw, layout.expert_bytes, measure_link(hosts[0][0], plan.device), host_s)


def _assemble(model, plan: _Plan, cfg: OffloadConfig) -> OffloadRuntime:
    """Change the model as `plan` says; every step is undone, in reverse, if a later one fails."""
    emulate_link, max_kl = cfg.emulate_link, cfg.max_kl if cfg.routing != "exact" else None
    arch, originals, layout, device = plan.arch, plan.originals, plan.layouts[0], plan.device
    layers, C, hw = arch.moe, plan.capacity, plan.hardware
    L, E, K = len(layers), arch.num_experts, arch.top_k
    with Undo() as undo:
        mp = measure_profile(model, arch, layout)  # the dense part's bytes: the same before and after the moves
        twin = plan.system.twin
        twins = None if twin is None else TwinStore.of(
            twin.precision, getattr(layout, "base", layout), device, originals=originals,
            files=None if plan.disk is None else plan.disk.files,
            link_s=copy_time_s(mp.at_precision(twin.precision), hw) if emulate_link else None)
        if plan.disk is None:
            hosts, kept = _pack(originals, layout, device, undo)
        else:  # the rows come from disk through a host cache: nothing to pack
            hosts, kept = plan.disk.open(plan.system, layout, device, undo), _strip(originals, layout, undo)
        move_model(model, device, undo)  # the dense remainder only: the routed experts are already out
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
        learner = None
        if plan.online is not None and isinstance(plan.system.predictor, OnlineForecaster):
            fc = plan.system.predictor
            learner = NoLearner() if not cfg.learn else ProcessLearner(
                fc.config, weights=None if fc.inner is None else fc.inner.w, save_to=plan.online)
            undo.push(learner.close)
            fc.use_learner(learner)
        routing = None if max_kl is None else CacheAwareRouting(
            max_kl, missing=pool.missing_row, resident=lambda l: pool.table_host[l] >= 0,
            posted=DeviceCacheRouting(max_kl, pool, K, rows=MAX_ROWS) if plan.control == "thread" and device.type == "cuda"
            else None)
        parts = dict(pregate=plan.pregate, routing=routing, record=cfg.record_trace)
        if plan.control == "thread":
            mailbox = Mailbox(L, K, device, fence)
            relay = None if host is None and plan.disk is None and twins is None else HostRelay(
                mailbox, model.config.hidden_size, layout.compute_dtype, host, [HostExecutor.clone(x) for x in originals],
                layout, hosts, control_failed=lambda: controller.thread.stopped, device=device,
                disk=None if plan.disk is None else (plan.disk.cache, pool.table_host), twins=twins is not None)
            controller = PostedController(plan.system, L, E, K, plan.meta, fence=fence, mailbox=mailbox, relay=relay,
                                          **parts)
            undo.push(controller.thread.close)
        else:
            controller = Controller(plan.system, L, E, K, plan.meta, **parts)
        clock = None if plan.disk is None else plan.disk.clock(plan.system, mp, hw, plan.start, pool)
        manager = build_manager(plan.system, model=mp, hardware=hw, capacity=C, start=plan.start,
                                observer=controller if clock is None else clock.observer(plan.disk.observer(controller)),
                                on_forecast=None if clock is None else clock.note_forecast)
        if host is not None:  # a prompt's misses split between the link and the host by this cost model
            host.price_prompts(prompt_costs(mp, hw))
        worker = CopyWorker(pool)
        undo.push(worker.close)
        controller.attach(manager, pool, worker, disk=clock)
        for l, (m, orig) in enumerate(zip(layers, originals)):
            setattr(m.block, m.experts_attr, OffloadedExperts(orig, l, layout, pool, controller, host, twins,
                                                                  eager=eager_forward, posted=posted_forward))
            undo.push(lambda m=m, orig=orig: setattr(m.block, m.experts_attr, orig))
        hooks = install_hooks(controller, model, [m.router for m in layers])
        undo.push(lambda: [h.remove() for h in hooks])
        shield_on()  # Ctrl-C now waits for the end of a state-machine transition (`signals`)
        undo.push(shield_off)
        return OffloadRuntime(model, layers, originals, plan.layouts, kept, pool, worker, controller, hooks,
                              system=cfg.system, residency=cfg.residency or C / (L * E), start=plan.start, model_profile=mp,
                              hardware=hw, host=host, twins=twins,
                              learner=None if learner is None else plan.system.predictor,  # its close keeps a last round
                              expert_dtype=cfg.expert_dtype or str(layout.compute_dtype).removeprefix("torch."))


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


def _pack(originals, layout: ExpertLayout | QuantLayout, device: torch.device, undo: Undo):
    """(host blocks [E, P] per layer, stripped Parameters per layer): layer by layer, so at most one
    layer's experts exist twice at a time; each layer is given its weights back if a later step fails.
    A quantized store cannot give the original weights back: their data is kept until offload ends."""
    hosts, kept = [], []
    for x in originals:
        E = x.num_experts
        home = next(x.parameters()).device
        host = torch.empty((E, layout.numel), dtype=layout.dtype, pin_memory=device.type == "cuda")
        layout.pack(x, host)
        data = None if layout.in_place else {n: getattr(x, n).data for n in layout.names}
        params = layout.strip(x)
        undo.push(lambda x=x, host=host, params=params, home=home, data=data: _unpack(x, layout, host, home, params,
                                                                                      data))
        hosts.append(host)
        kept.append(params)
    return hosts, kept


def _strip(originals, layout: ExpertLayout, undo: Undo) -> list:
    """The routed parameters of a model whose experts stay on disk (never materialised) taken out,
    put back as they were if a later step fails."""
    kept = []
    for x in originals:
        params = layout.strip(x)
        undo.push(lambda x=x, params=params: [x.register_parameter(n, p) for n, p in params.items()])
        kept.append(params)
    return kept


def _unpack(x, layout, host, home, params, data) -> None:
    """Undo `_pack` of one layer: the weights from the host block, or the original `data` when kept."""
    if data is None:
        layout.unpack(x, host, home, params)
        return
    for name, param in params.items():
        param.data = data[name]
        x.register_parameter(name, param)

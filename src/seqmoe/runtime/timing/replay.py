"""Real routing replayed through the runtime and timed against full load: the real-size harness.

    result = replay_bench(model, replay, train=train, predictor=DIR, systems=(...), residencies=(...))
    print(format_rows(result))

`model` is built by `seqmoe.arch.published.build_model` and forced by `forced.ForcedRouting` to the routing
of `replay` (requests back to back). Every run computes every position of every request, one
forward each: on CUDA with `DecodeGraph` (one CUDA graph per step, the control plane on its thread),
on the CPU with an eager loop (the inline control plane, the CPU's default). The first request
warms up (capture, caches) and is not timed, the others are. The full model runs first; each
offloaded run (`replay=`, so that oracles run and the forecaster sees the trace's tokens) must
give the full model's argmax at every position. The cost model is this machine's: the full model's measured time per token, and the
link, measured on CUDA (`measure_link`) or on the CPU emulated at `link_ratio` x one layer's
expert compute. Each row puts the simulator's time per token (the runtime's own virtual clock, the
simulator's state machine on the same routing and cost model) next to the measured one; hit
rates and copies count every position, the warm-up request's too.
"""

from __future__ import annotations

import copy
import os
import time

import numpy as np
import torch

from seqmoe.arch import cache_kwarg, model_arch
from seqmoe.base.errors import UserError
from seqmoe.brain.manager.systems import SYSTEMS
from seqmoe.config import COMPARED_RESIDENCIES
from seqmoe.runtime.core import costs
from seqmoe.runtime.core.mapped import device_view
from seqmoe.runtime.eager.host_exec import model_host_expert_s
from seqmoe.runtime.offload import measure_profile, offload
from seqmoe.runtime.posted.graph import DecodeGraph
from seqmoe.runtime.timing.decode import expert_layer_seconds, measured_hardware
from seqmoe.runtime.timing.forced import ForcedRouting
from seqmoe.trace.schema import RoutingTrace

_STATS = ("hit_rate", "ready_rate", "late_rate", "miss_rate", "prefetches", "wasted_copies", "copies", "sim_copies",
          "skipped_copies", "decision_us_per_token")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode(target, forced: ForcedRouting, replay: RoutingTrace, device, between=None) -> tuple[list, float, int]:
    """(argmax tokens per request, seconds and positions of the timed requests: all but the first).
    `between()` runs once the warm-up request is done, before the clock starts."""
    off = replay.request_offsets
    inline = getattr(target, "control", "thread") == "inline"  # an offloaded model with an inline control plane
    if device.type == "cuda" and not inline:
        graph = DecodeGraph(target, max_length=int(np.diff(off).max()) + 1)
        # One forward per position: the prompt, then n - 1 decode steps (and an argmax never fed back).
        generate = lambda n: graph.generate(torch.zeros((1, 1), dtype=torch.long), max_new_tokens=n)[0, 1:].tolist()  # noqa: E731
    else:
        model = target.model if hasattr(target, "controller") else target
        generate = lambda n: _eager(model, n, device)  # noqa: E731
    outs, wall = [], 0.0
    for r, (a, b) in enumerate(zip(off[:-1].tolist(), off[1:].tolist())):
        if r == 1 and between is not None:
            between()
        forced.start(a)
        _sync(device)
        t0 = time.perf_counter()
        outs.append(generate(b - a))
        _sync(device)
        if r:
            wall += time.perf_counter() - t0
    return outs, wall, int(off[-1] - off[1])


def _eager(model, n: int, device) -> list[int]:
    """Argmax after each of n one-token forwards of a new request (the inline runtime)."""
    from transformers import DynamicCache  # transformers: only when this runs

    cache, key, out = DynamicCache(config=model.config), cache_kwarg(model), []
    token = torch.zeros((1, 1), dtype=torch.long, device=device)  # replaced by the trace's token (ForcedRouting)
    with torch.no_grad():
        for t in range(n):
            logits = model(input_ids=token, cache_position=torch.tensor([t], device=device), use_cache=True,
                           **{key: cache}).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def _event_seconds(fn, repeats: int) -> float:
    """Mean seconds of `fn()` on the current CUDA stream, timed with events after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure_link(expert_bytes: int, device: torch.device, repeats: int = 10) -> dict:
    """The link as the runtime uses it: pinned host -> device copies (`costs.measure_link`: per-copy
    overhead and bandwidth), and a device kernel reading one expert in place from mapped host memory
    (a miss served in place)."""
    host = torch.empty(expert_bytes, dtype=torch.uint8, pin_memory=True)
    rate, overhead = costs.measure_link(host, device)
    dev = torch.empty(expert_bytes, dtype=torch.uint8, device=device)
    mapped = device_view(host, device)
    read_s = _event_seconds(lambda: dev.copy_(mapped), repeats)
    return {"h2d_bytes_per_s": rate, "copy_overhead_s": overhead, "expert_copy_s": overhead + expert_bytes / rate,
            "in_place_read_s": read_s, "in_place_bytes_per_s": expert_bytes / read_s}


def replay_bench(model, replay: RoutingTrace, *, train: RoutingTrace | None = None, predictor=None,
                 systems=("on-demand-lru",), residencies=COMPARED_RESIDENCIES, link_ratio: float = 1.0,
                 miss: str = "copy", control: str | None = None, log=lambda line: None) -> dict:
    """Time the full model and `systems` x `residencies` offloaded on the routing of `replay` (see the module doc).

    Args:
        model: built by `seqmoe.arch.published.build_model` (left as it was).
        replay: at least two requests; the first warms up.
        train: training split of the same model's routing (start placement, statistics).
        predictor: the forecaster of the `seqmoe*` systems (checkpoint folder or `SeqPredictor`).
        link_ratio: CPU only: one expert copy takes this many times one layer's measured expert compute.
        miss, control: `offload`'s (default: every miss copied, the device's control plane); on CUDA an
            inline control plane decodes eagerly, where the full model's time is a captured graph's.
    """
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise UserError(f"unknown system {', '.join(unknown)}; choose from: {', '.join(SYSTEMS)}")
    if replay.num_requests < 2:
        raise UserError("the replay needs at least two requests: the first one warms up and is not timed")
    device = next(model.parameters()).device
    arch = model_arch(model)
    mp = measure_profile(model, arch, arch.layout(arch.moe[0].experts))
    forced = ForcedRouting(model, replay)
    try:
        full = {}
        run_full = lambda: full.update(zip(("tokens", "wall", "n"), _decode(model, forced, replay, device)))  # noqa: E731
        if device.type == "cuda":
            run_full()
        else:  # the emulated link's copy time is a multiple of one layer's expert compute
            expert_s = expert_layer_seconds(arch.moe, run_full)
        token_s = full["wall"] / full["n"]
        log(f"full load: {1e3 * token_s:.3f} ms/token over {full['n']} tokens")
        host_s = model_host_expert_s(model)
        if device.type == "cuda":
            link = measure_link(mp.expert_bytes, device)
            hw = measured_hardware(mp, token_s, link["expert_copy_s"], link["copy_overhead_s"],
                                   name="this GPU (measured)", host_s=host_s)
        else:
            link = {"emulated": True, "ratio": link_ratio, "expert_layer_s": expert_s, "expert_copy_s": link_ratio * expert_s}
            hw = measured_hardware(mp, token_s, link["expert_copy_s"], host_s=host_s)
        link["host_expert_s"] = host_s
        runs = [_run(model, forced, replay, device, system, r, train, predictor, hw, full["tokens"], token_s, log,
                     miss, control) for system in systems for r in residencies]
    finally:
        forced.remove()
    return {"model": model.config.model_type, "layers": mp.num_layers, "experts": mp.num_experts, "top_k": mp.top_k,
            "expert_bytes": mp.expert_bytes, "device": str(device), "timed_tokens": full["n"], "link": link,
            "hardware": {"h2d_bytes_per_s": hw.h2d_bytes_per_s, "copy_overhead_s": hw.copy_overhead_s,
                         "hbm_bytes_per_s": hw.hbm_bytes_per_s},
            "full": {"ms_per_token": 1e3 * token_s, "tokens_per_s": 1.0 / token_s}, "runs": runs}


def _run(model, forced, replay, device, system, r, train, predictor, hw, full_tokens, token_s, log, miss,
         control) -> dict:
    if not SYSTEMS[system].needs_predictor:
        pred = None
    else:  # a checkpoint folder loads fresh; a forecaster object is copied (it keeps state)
        pred = predictor if isinstance(predictor, (str, os.PathLike)) else copy.deepcopy(predictor)
    rt = offload(model, r, system, train=train, predictor=pred, hardware=hw, emulate_link=device.type == "cpu",
                 replay=replay, miss=miss, control=control)
    marks = {}
    try:
        outs, wall, n = _decode(rt, forced, replay, device, between=lambda: marks.update(rt.stats()))
        rt.synchronize()
        end = rt.stats()
    finally:
        rt.restore()
    sim_s = (end["sim_time_s"] - marks["sim_time_s"]) / (end["tokens"] - marks["tokens"])
    row = {"system": system, "residency": r, "capacity": end["capacity"], "miss": end["miss"], "control": rt.control,
           "misses_cpu": end["misses_cpu"], "misses_in_place": end["misses_in_place"], "tokens_per_s": n / wall,
           "ms_per_token": 1e3 * wall / n, "vs_full": token_s / (wall / n), "exact": outs == full_tokens,
           "sim_ms_per_token": 1e3 * sim_s, "sim_over_measured": sim_s / (wall / n),
           "bytes_copied": end["bytes_copied"], "sim_stall_s": end["sim_stall_s"],
           **{k: end[k] for k in _STATS}}
    log(f"{system} r={r}: {row['ms_per_token']:.3f} ms/token (simulated {row['sim_ms_per_token']:.3f}), "
        f"hit rate {row['hit_rate']:.3f}, exact {row['exact']}")
    return row


def format_rows(result: dict) -> str:
    """The runs as a text table, full load first."""
    head = (f"{'system':<24} {'residency':>9} {'ms/token':>9} {'sim ms':>8} {'sim/meas':>8} {'vs full':>7} "
            f"{'hit':>6} {'late':>6} {'copies':>7} {'exact':>5}")
    full = result["full"]
    lines = [head, "-" * len(head), f"{'full load':<24} {'-':>9} {full['ms_per_token']:>9.3f}"]
    for r in result["runs"]:
        lines.append(f"{r['system']:<24} {r['residency']:>9.2f} {r['ms_per_token']:>9.3f} {r['sim_ms_per_token']:>8.3f} "
                     f"{r['sim_over_measured']:>8.2f} {r['vs_full']:>7.2f} {r['hit_rate']:>6.3f} {r['late_rate']:>6.3f} "
                     f"{r['copies']:>7} {'yes' if r['exact'] else 'NO':>5}")
    return "\n".join(lines)

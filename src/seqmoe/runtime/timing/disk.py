"""Real routing replayed through a model streamed from disk, timed against the simulator's figure.

    result = disk_replay_bench("ckpt/", replay, train=train, systems=("on-demand-lru", "seqmoe"),
                               residency=0.1, host_memory="8GiB")

The checkpoint (`checkpoint.write_checkpoint`: a published shape, seeded weights) is loaded with
`seqmoe.load`, its routers forced to `replay` (`forced.ForcedRouting`), and decoded on the CPU as
`replay.replay_bench` decodes: one forward per position, the first request warming up. The cost
model is this machine's, measured first (`measure_machine`): the full-load time per token of this
runtime (a replay that routes every position as its first one, so every expert it needs stays
resident after one position), one expert's copy (a memory copy: the CPU's "link") and one expert's
read from the checkpoint (the reader's own path, one at a time, while the model decodes). Each run's simulated time per
token is the runtime's own virtual clock: the simulator's state machine and disk tier on the same
routing, budgets and cost model. Peak resident memory is measured per run (`VmHWM`, reset first).
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

import numpy as np
import torch

import seqmoe
from seqmoe.brain.manager.systems import system_spec
from seqmoe.runtime.proc import reset_peak, status_bytes
from seqmoe.runtime.timing.decode import measured_hardware
from seqmoe.runtime.timing.forced import ForcedRouting
from seqmoe.runtime.timing.replay import _decode, _eager
from seqmoe.trace.schema import RoutingTrace

_STATS = ("hit_rate", "miss_rate", "copies", "host_rows", "host_hit_rate", "disk_reads", "disk_bytes_per_token",
          "sim_host_hit_rate", "sim_disk_bytes_per_token", "sim_disk_stall_s",
          "sim_stall_s", "sim_time_s", "dense_bytes", "rss_before_load_bytes", "device_expert_bytes", "host_expert_bytes")


def repeated(replay: RoutingTrace, n: int) -> RoutingTrace:
    """Two requests of `n` positions, each routed as `replay`'s first position (the full-load replay)."""
    rows = lambda a: None if a is None else np.repeat(a[:1], 2 * n, axis=0)  # noqa: E731
    return dataclasses.replace(replay, expert_ids=rows(replay.expert_ids), gate_weights=rows(replay.gate_weights),
                               token_ids=rows(replay.token_ids), request_offsets=np.array([0, n, 2 * n]),
                               pregate_logits=None, router_logits=None)


def _replay_run(folder, replay: RoutingTrace, probe=None, **options) -> tuple[dict, dict, float, int, list]:
    """(stats at the end, stats after warm-up, wall seconds and positions timed, argmax tokens) of one
    streamed run; `probe(runtime, forced)` runs before it closes. Its memory is freed before this returns."""
    before = status_bytes("VmRSS")
    model, rt = seqmoe.load(folder, replay=replay, device="cpu", **options)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())  # the experts' are stripped
    forced = ForcedRouting(model, replay)
    marks = {}
    try:
        outs, wall, n = _decode(rt, forced, replay, torch.device("cpu"), between=lambda: marks.update(rt.stats()))
        rt.synchronize()
        end = rt.stats() | {"dense_bytes": dense, "rss_before_load_bytes": before}
        if probe is not None:
            probe(rt, forced)
    finally:
        forced.remove()
        rt.close()
        model = rt = forced = None  # noqa: F841 (dropped for the collection below)
        gc.collect()  # the model and its runtime refer to each other: free the pool and host cache now
    return end, marks, wall, n, outs


def _time_reads(rt, forced, positions: int) -> tuple[float, float]:
    """(median seconds of one expert read from the checkpoint, of one expert row copy), timed one at a
    time from all over the checkpoint while the model decodes `positions` more (a read shares the
    CPU with the model's compute, as in a run)."""
    files, cache = rt.pool.cache.files, rt.pool.cache
    row, other = torch.empty_like(cache.buf[0]), torch.empty_like(cache.buf[0])
    rng = np.random.default_rng(0)
    read_s, copy_s, done = [], [], threading.Event()

    def reads():
        while not done.is_set() or len(read_s) < 4:
            l, e = int(rng.integers(rt.pool.num_layers)), int(rng.integers(rt.pool.num_experts))
            t0 = time.perf_counter()
            files.read_into(l, e, row)
            read_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            other.copy_(row)
            copy_s.append(time.perf_counter() - t0)

    reader = threading.Thread(target=reads)
    reader.start()
    try:
        forced.start(0)
        _eager(rt.model, positions, torch.device("cpu"))
    finally:
        done.set()
        reader.join()
    return float(np.median(read_s)), float(np.median(copy_s))


def measure_machine(folder, replay: RoutingTrace, *, residency: float, positions: int = 12, log=print) -> dict:
    """This machine's cost model for `folder`'s model (see the module doc): the hardware profile
    and what was measured."""
    got = {}
    probe = lambda rt, forced: got.update(times=_time_reads(rt, forced, positions), mp=rt.model_profile)  # noqa: E731
    end, marks, wall, n, _ = _replay_run(folder, repeated(replay, positions), probe, residency=residency,
                                         host_memory="1GiB", system="on-demand-lru", miss="copy")
    token_s = wall / n
    (disk_s, copy), mp = got["times"], got["mp"]
    log(f"full load (every routed expert resident): {1e3 * token_s:.1f} ms/token over {n} positions")
    hw = measured_hardware(mp, token_s, copy, name="this machine (measured)")
    hw = dataclasses.replace(hw, disk_bytes_per_s=mp.expert_bytes / disk_s, disk_latency_s=0.0,
                             source=hw.source + f", {1e3 * disk_s:.2f} ms per expert read from disk")
    log(f"one expert: copy {1e3 * copy:.2f} ms, read from disk {1e3 * disk_s:.2f} ms "
        f"({mp.expert_bytes / disk_s / 1e9:.2f} GB/s)")
    return {"hardware": hw, "full_ms_per_token": 1e3 * token_s, "copy_ms": 1e3 * copy, "disk_read_ms": 1e3 * disk_s,
            "expert_bytes": mp.expert_bytes}


def disk_replay_bench(folder, replay: RoutingTrace, *, systems=("on-demand-lru", "seqmoe"), residency: float = 0.1,
                      host_memory="8GiB", train: RoutingTrace | None = None, predictor=None, log=print) -> dict:
    """Measure this machine, then time each of `systems` streamed over `replay` (see the module doc);
    `predictor`: the trained forecaster of the systems that use one (default: they learn online)."""
    machine = measure_machine(folder, replay, residency=residency, log=log)
    runs, first = [], None
    for system in systems:
        reset_peak()
        end, marks, wall, n, outs = _replay_run(folder, replay, residency=residency, host_memory=host_memory,
                                                system=system, miss="copy", train=train, hardware=machine["hardware"],
                                                predictor=predictor if system_spec(system).needs_predictor else None)
        sim_s = (end["sim_time_s"] - marks["sim_time_s"]) / (end["tokens"] - marks["tokens"])
        measured_s = wall / n
        first = outs if first is None else first
        row = {"system": system, "residency": residency, "host_memory": str(host_memory), "ms_per_token": 1e3 * measured_s,
               "sim_ms_per_token": 1e3 * sim_s, "sim_over_measured": sim_s / measured_s,
               "vs_full": machine["full_ms_per_token"] / (1e3 * measured_s), "same_tokens": outs == first,
               "peak_rss_bytes": status_bytes("VmHWM"), **{k: end.get(k) for k in _STATS}}
        log(f"{system}: {row['ms_per_token']:.1f} ms/token (simulated {row['sim_ms_per_token']:.1f}), "
            f"{row['disk_bytes_per_token'] / 2**20:.1f} MiB read from disk per token, host hit rate "
            f"{row['host_hit_rate']:.3f}")
        runs.append(row)
    hw = machine.pop("hardware")
    return {**machine, "hardware": dataclasses.asdict(hw), "timed_tokens": n, "runs": runs}

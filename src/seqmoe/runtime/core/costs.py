"""The cost table a runtime measures at start (`offload(..., hardware="measured")`): one expert's
copy over the link, with its fixed part, and one expert computed on the host CPU, round trip
included. They replace the link and host fields of the hardware profile; its device side (HBM
rate, memory) stays, so the virtual clock keeps pricing compute as the profile says.

Each figure is the median of a few timed repeats after one untimed call, made with the operations
the runtime itself runs: the copy worker's `copy_` into device memory (then a synchronisation, as
`ExpertPool.fill` does), and `HostExecutor.submit` of one routed expert for one token, its output
moved back to the device.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np
import torch

from seqmoe.costs.host_cost import host_fields
from seqmoe.costs.profiles import HardwareProfile

REPEATS = 7
SMALL_BYTES = 4096
"""The small copy whose time is taken as the fixed cost of one copy."""


def _median_s(fn, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def measure_link(row: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(bytes per second, fixed seconds per copy) of copying host `row` (one packed expert) into
    device memory: copies of `SMALL_BYTES`, a quarter, a half and all of it, a least-squares line
    through their times (time = overhead + bytes / bandwidth)."""
    dst = torch.empty_like(row, device=device)
    n, size = row.numel(), row.element_size()
    counts = sorted({max(1, SMALL_BYTES // size), max(1, n // 4), max(1, n // 2), n})
    sync = _sync(device)
    times = [_median_s(lambda k=k: dst[:k].copy_(row[:k], non_blocking=True), sync) for k in counts]
    slope, overhead = np.polyfit(np.array(counts, float) * size, np.array(times), 1)
    if slope <= 0:  # too fast to tell the sizes apart: all of it counts as bandwidth
        return n * size / max(times[-1], 1e-9), 0.0
    return 1.0 / slope, max(0.0, float(overhead))


def measure_host_expert_s(executor, clone, layout, host_rows: torch.Tensor, hidden_size: int, top_k: int,
                          device: torch.device) -> float:
    """Seconds for one expert of `host_rows` computed by `executor` for one token whose hidden state
    is on `device`, from the hand-over to its output back on `device`."""
    x = torch.zeros(1, hidden_size, dtype=layout.compute_dtype, device=device)
    index = torch.zeros(1, top_k, dtype=torch.long, device=device)
    weights = torch.full((1, top_k), 1.0 / top_k, dtype=layout.compute_dtype, device=device)
    return _median_s(lambda: executor.submit(clone, layout, host_rows, [0], x, index, weights).result().to(device),
                     _sync(device))


def measured_profile(hw: HardwareProfile, expert_bytes: int, link: tuple[float, float], host_s: float) -> HardwareProfile:
    """`hw` with its link (`measure_link`) and host CPU (`measure_host_expert_s`) replaced by measurements."""
    rate, overhead = link
    return dataclasses.replace(hw, name=f"{hw.name}, link and host measured", h2d_bytes_per_s=rate,
                               copy_overhead_s=overhead, **host_fields(expert_bytes, host_s, overhead),
                               source=f"{hw.source}; measured at start: {rate / 1e9:.3g} GB/s + {1e6 * overhead:.1f} us "
                                      f"per copy, {1e6 * host_s:.1f} us per host expert")

"""Replay a routing trace as batch-1 decode against a cost model (DESIGN.md's protocol).

    counts = simulate(trace, system, model=..., hardware=..., capacity=C, start=placement)

The decisions are the memory manager's (`seqmoe.manager`), driven by the same `Driver` the
runtime's control plane uses; `sim` never imports `runtime`.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from seqmoe.manager import Driver, System, build_manager
from seqmoe.manager.counts import SimCounts
from seqmoe.profiles import HardwareProfile, ModelProfile
from seqmoe.trace.schema import RoutingTrace, check_dims


def simulate(trace: RoutingTrace, system: System, *, model: ModelProfile, hardware: HardwareProfile,
             capacity: int, start, progress: bool = False, compiled: bool = True) -> SimCounts:
    """Replay `trace` as batch-1 decode with `system` managing `capacity` slots.

    Args:
        trace: the routing to replay (requests back to back).
        system: eviction policy, predictor, scheduler; reset here from `start`.
        model, hardware: the cost model.
        capacity: C, slots in the pool.
        start: the start placement, at most C uids (`seqmoe.manager.start_placement`).
        progress: show a progress bar.
        compiled: let the compiled manager run the systems it can (`seqmoe.manager.build_manager`);
            False: the reference Python state machine (the same decisions, slower).

    Returns:
        Counts and times of the replay (see `seqmoe.manager.summarize` for the metrics).
    """
    check_dims("trace", trace, model)
    driver = Driver(build_manager(system, model=model, hardware=hardware, capacity=capacity, start=start,
                                  compiled=compiled))
    L, K = trace.num_layers, trace.top_k
    flat = trace.uids().reshape(-1, K).astype(np.int64)  # [T * L, K]
    if not driver.manager.takes_arrays:
        flat = flat.tolist()
    ids = trace.expert_ids
    tokens = trace.token_ids.tolist() if trace.token_ids is not None else None
    starts = set(trace.request_offsets[:-1].tolist())
    bar = tqdm(total=trace.num_tokens, disable=not progress, unit="tok", desc=system.name, mininterval=0.5, leave=False)
    for t in range(trace.num_tokens):
        driver.token_start(tokens[t] if tokens is not None else None, t in starts)
        row = ids[t]
        for l in range(L):
            step = t * L + l
            driver.reveal(l, row[l], flat[step])
            driver.layer_end(l)
        if t % 256 == 255:
            bar.update(256)
    bar.close()
    return driver.finish()

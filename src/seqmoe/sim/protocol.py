"""Other papers' replay protocols as options of a replay (docs/DESIGN.md, "Protocol extensions").

MoE-Beyond (arXiv 2508.17137) scores a cache with free prefetches, a pool refilled for every
prompt and ten warm-up tokens per prompt that are replayed but not scored. The three are options
here, each usable alone:

    hw = free_link(hardware)                           # seqmoe.costs.profiles: copies cost nothing
    scored = scored_tokens(trace.request_offsets, 10)  # [T] bool: the tokens counted
    starts = reset_starts("random", capacity=C, ...)   # seqmoe.brain.manager.placement: each request's pool
    counts = replay_per_request(trace, simulate_one, starts=starts)
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.manager.counts import SimCounts, spans_total
from seqmoe.trace.schema import RoutingTrace

TIME_FIELDS = ("stall_s", "time_s", "full_load_time_s", "full_load_fraction", "tokens_per_s", "time_per_step_s",
               "copy_time_s", "bound_time_s", "bound_fraction", "paths_bound_time_s", "paths_bound_fraction")
"""A row's fields that are times, or ratios of times: not a time on a free link."""


def untimed(row: dict) -> dict:
    """A free-link row: its time fields set to None, and a note saying why."""
    row.update({name: None for name in TIME_FIELDS if name in row})
    row["time_note"] = "free link: copies cost nothing, so the replay's times are not a time (hit rates only)"
    return row


def scored_tokens(request_offsets: np.ndarray, warmup: int) -> np.ndarray:
    """[T] bool: every token but the first `warmup` of each request."""
    offsets = np.asarray(request_offsets, dtype=np.int64)
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], np.diff(offsets))
    return position >= warmup


def replay_per_request(trace: RoutingTrace, simulate_one, *, starts) -> SimCounts:
    """Replay each request of `trace` alone from its own start placement: `simulate_one(span, start)`
    replays the tokens of one (a range, numbered as in `trace`; the system and its learned state carry
    over, the pool does not); the requests' counts summed."""
    off = trace.request_offsets
    return spans_total([(SimCounts(), simulate_one(range(int(off[r]), int(off[r + 1])), starts(r)))
                        for r in range(trace.num_requests)])

"""Counts of one run (simulated or live) and the metrics docs/DESIGN.md asks of every run, computed the same way for all."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from seqmoe.brain.manager.miss_paths import paths_bound_time_s


@dataclass
class SimCounts:
    """What a replay counted. Activations are (token, layer, expert) triples."""

    ready: int = 0
    """Hits whose copy had finished when the layer's experts were due."""
    late: int = 0
    """Hits (copy issued before the reveal) the layer had to wait for."""
    misses: int = 0
    """Activations neither resident nor on their way at the reveal (served by a path of `seqmoe.brain.manager.miss_paths`)."""
    in_place: int = 0
    """Misses read in place from the host row (no slot)."""
    twin: int = 0
    """Misses served by reading their low-bit twin (`seqmoe.brain.manager.miss_paths.Twin`; no slot)."""
    twin_weight: float = 0.0
    """Gate weight of the activations the twins served (their quality budget spent)."""
    twin_bytes: int = 0
    """Bytes per twin read (0: no twins)."""
    host: int = 0
    """Misses (or, for `cpu-all`, activations) computed on the host CPU."""
    prefetches: int = 0
    """Prefetch copies issued."""
    copies: int = 0
    """Copies run, demand and prefetch."""
    wasted_copies: int = 0
    """Prefetched experts evicted before any use."""
    cancelled: int = 0
    """Queued prefetches cancelled before their copy started, to free a slot for a demand copy."""
    stall_s: float = 0.0
    """Time the expert computation waited for copies, in-place reads or the host CPU."""
    time_s: float = 0.0
    """Simulated decode time of the whole trace."""
    full_load_time_s: float = 0.0
    """The same trace with every expert resident."""
    decision_s: float = 0.0
    """Host wall time spent in eviction, prediction and scheduling (measured, not simulated)."""
    num_tokens: int = 0
    """Tokens decoded (a batched step's rows summed)."""
    steps: int = 0
    """Decode steps (= tokens at batch 1)."""
    expert_reads: int = 0
    """(step, layer, expert) triples: each layer's distinct experts, computed once for all their rows
    (= activations at batch 1)."""
    copy_time_s: float = 0.0
    """Seconds per expert copy under the hardware profile."""
    per_expert_s: float = 0.0
    """Device seconds per routed expert activation."""
    host_expert_s: float | None = None
    """Host CPU seconds per expert (None: the profile describes no host)."""
    routing: dict | None = None
    """A replay's cache-aware routing stats (`seqmoe.brain.rerouting`); None: exact routing."""
    windows: list | None = None
    """A replay's counts per window of tokens (`simulate(window_tokens=...)`); None: not asked."""
    host_rows: int = 0
    """H, rows of the host cache in front of the disk (`seqmoe.runtime.disk`); 0: no disk tier."""
    host_needs: int = 0
    """Transfers that needed a host row (copies, in-place reads, host-CPU experts)."""
    host_hits: int = 0
    """Needs whose row was in the host cache (read ahead included)."""
    disk_reads: int = 0
    """Experts read from disk, on demand and ahead."""
    disk_ahead_reads: int = 0
    """Experts read from disk ahead of a need (the forecast policy)."""
    disk_ahead_used: int = 0
    """Rows read ahead that were needed before their eviction."""
    disk_stall_s: float = 0.0
    """The part of `stall_s` spent waiting for the disk."""
    disk_read_s: float = 0.0
    """Seconds per expert read from disk (latency + bytes / bandwidth)."""


def summarize(c: SimCounts, *, expert_bytes: int, belady_misses: int | None = None,
              disk_belady_misses: int | None = None) -> dict:
    """The metrics of one run as a JSON-serialisable dict (rates 0 before the first activation).

    Args:
        c: counts of the run.
        expert_bytes: bytes per expert copy.
        belady_misses: N_opt, Belady's demand misses at the same capacity and start placement; the
            bound fields are left out without it (a live run does not know its future).
            `bound_time_s` is the copy-only bound (a bound for systems that copy every miss);
            `paths_bound_time_s` holds for every system with these slots, link and host CPU
            (`seqmoe.brain.manager.miss_paths`).
            `copies_per_belady` is copies / N_opt (None when Belady copies nothing).
        disk_belady_misses: with a disk tier, Belady's misses at C + H slots from the same start: no
            system reads fewer experts from disk, one at a time, so both bounds are at least that many
            disk reads (docs/DESIGN.md, "The disk tier").
    """
    n = c.ready + c.late + c.misses
    rate = (lambda x: x / n) if n else (lambda x: 0.0)
    per_token = (lambda x: 1e6 * x / c.num_tokens) if c.num_tokens else (lambda x: 0.0)
    row = {
        "hit_rate": rate(c.ready + c.late),
        "ready_rate": rate(c.ready),
        "late_rate": rate(c.late),
        "miss_rate": rate(c.misses),
        "activations": n,
        "ready": c.ready,
        "late": c.late,
        "misses": c.misses,
        "misses_in_place": c.in_place,
        "misses_cpu": c.host,
        "misses_twin": c.twin,
        "prefetches": c.prefetches,
        "copies": c.copies,
        "bytes_copied": c.copies * expert_bytes,
        "bytes_read_in_place": c.in_place * expert_bytes,
        "bytes_read_twin": c.twin * c.twin_bytes,
        "twin_weight_per_token": c.twin_weight / c.num_tokens if c.num_tokens else 0.0,
        "wasted_copies": c.wasted_copies,
        "cancelled_prefetches": c.cancelled,
        "stall_s": c.stall_s,
        "time_s": c.time_s,
        "full_load_time_s": c.full_load_time_s,
        "full_load_fraction": c.full_load_time_s / c.time_s if c.time_s else 1.0,
        "tokens_per_s": c.num_tokens / c.time_s if c.time_s else 0.0,
        "steps": c.steps,
        "time_per_step_s": c.time_s / c.steps if c.steps else 0.0,
        "decision_us_per_token": per_token(c.decision_s),
        "copy_time_s": c.copy_time_s,
        "host_expert_s": c.host_expert_s,
        **(c.routing or {}),
        **({"windows": c.windows} if c.windows else {}),
        **(_disk_fields(c, expert_bytes) if c.host_rows else {}),
    }
    if belady_misses is not None:
        bound = max(c.full_load_time_s, belady_misses * c.copy_time_s)
        paths = paths_bound_time_s(full_load_time_s=c.full_load_time_s, activations=c.expert_reads, per_expert_s=c.per_expert_s,
                                   copy_time_s=c.copy_time_s, host_expert_s=c.host_expert_s,
                                   belady_misses=belady_misses)
        if c.host_rows and disk_belady_misses is not None:
            disk_bound = disk_belady_misses * c.disk_read_s
            bound, paths = max(bound, disk_bound), max(paths, disk_bound)
            row.update(disk_belady_misses=disk_belady_misses, disk_bound_time_s=disk_bound)
        row.update(belady_misses=belady_misses, bound_time_s=bound, bound_fraction=bound / c.time_s,
                   paths_bound_time_s=paths, paths_bound_fraction=paths / c.time_s,
                   copies_per_belady=c.copies / belady_misses if belady_misses else None)
    return row


def _disk_fields(c: SimCounts, expert_bytes: int) -> dict:
    """The disk tier's metrics (a run with a host cache in front of the disk)."""
    return {
        "host_rows": c.host_rows,
        "disk_reads": c.disk_reads,
        "disk_bytes": c.disk_reads * expert_bytes,
        "disk_bytes_per_token": c.disk_reads * expert_bytes / c.num_tokens if c.num_tokens else 0.0,
        "host_needs": c.host_needs,
        "host_hits": c.host_hits,
        "host_hit_rate": c.host_hits / c.host_needs if c.host_needs else 0.0,
        "disk_ahead_reads": c.disk_ahead_reads,
        "disk_ahead_used": c.disk_ahead_used,
        "disk_stall_s": c.disk_stall_s,
        "disk_read_s": c.disk_read_s,
    }


ADDITIVE = ("ready", "late", "misses", "in_place", "twin", "twin_weight", "host", "prefetches", "copies",
            "wasted_copies", "cancelled", "stall_s", "time_s", "full_load_time_s", "decision_s", "num_tokens", "steps",
            "expert_reads", "host_needs", "host_hits", "disk_reads", "disk_ahead_reads", "disk_ahead_used",
            "disk_stall_s")
"""The fields of `SimCounts` that count events or sum times (the rest are per-unit prices and labels)."""


def spans_total(spans: list[tuple[SimCounts, SimCounts]]) -> SimCounts:
    """The counts of the spans (start, end) summed (each span: end minus start); per-unit fields from the last end."""
    total = dataclasses.replace(spans[-1][1])
    for name in ADDITIVE:
        setattr(total, name, sum(getattr(end, name) - getattr(start, name) for start, end in spans))
    return total

"""Capacity, the start placement every system shares, and the checks of residency and capacity.

    C = capacity_for(residency, L, E, K)      # floor(r * L * E) slots; UserError unless C >= K
    C = capacity_for_bytes(budget, expert_bytes, L, E, K, "--expert-memory 2GiB")   # the experts a byte budget holds
    start = start_placement(train, C)         # the C experts used most often in the training split
"""

from __future__ import annotations

import numbers

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.costs.precision import format_bytes
from seqmoe.trace.schema import RoutingTrace


def check_residency(residency: float) -> None:
    """UserError unless residency is a number in (0, 1]."""
    if isinstance(residency, bool) or not isinstance(residency, numbers.Real):
        raise UserError(f"residency must be a number in (0, 1], got {residency!r} ({type(residency).__name__})")
    if not 0.0 < residency <= 1.0:
        raise UserError(f"residency must be in (0, 1], got {residency}")


def check_capacity(capacity: int, top_k: int, residency: float | None = None, num_uids: int | None = None) -> None:
    """UserError unless `capacity` slots hold one layer's top-k experts (named by the residency when given)."""
    if capacity >= top_k:
        return
    if residency is None or num_uids is None:
        raise UserError(f"{capacity} slots cannot hold one layer's top-{top_k} experts; raise the residency")
    raise UserError(f"residency {residency} gives {capacity} slots for {num_uids} experts, fewer than the top-{top_k} "
                    f"experts one layer needs; use residency >= {top_k / num_uids:.4g}")


def capacity_for(residency: float, num_layers: int, num_experts: int, top_k: int = 1) -> int:
    """C = floor(r * L * E) slots for residency r in (0, 1] (checked by the configurations that take it:
    `seqmoe.config`); UserError when they cannot hold top-k experts."""
    capacity = int(np.floor(residency * num_layers * num_experts + 1e-9))
    check_capacity(capacity, top_k, residency, num_layers * num_experts)
    return capacity


def capacity_for_bytes(budget: int, expert_bytes: int, num_layers: int, num_experts: int, top_k: int,
                       what: str) -> int:
    """C = the experts of `expert_bytes` that `budget` bytes hold (at most L * E); UserError naming
    `what` (the budget's source) when they cannot hold one layer's top-k experts."""
    capacity = min(num_layers * num_experts, budget // expert_bytes)
    if capacity < top_k:
        raise UserError(f"{what} holds {capacity} experts of {format_bytes(expert_bytes)}, fewer than the {top_k} one "
                        f"layer needs; give at least {format_bytes(top_k * expert_bytes)}")
    return capacity


def uid_counts(trace: RoutingTrace) -> np.ndarray:
    """[L * E] int64: how often each global expert id is used in `trace`."""
    return np.bincount(trace.uids().reshape(-1), minlength=trace.num_layers * trace.num_experts)


def start_placement(train: RoutingTrace, capacity: int) -> list[int]:
    """The `capacity` uids used most often in `train`, most used first, ties by lower uid."""
    counts = uid_counts(train)
    order = np.lexsort((np.arange(len(counts)), -counts))
    return order[:capacity].tolist()


RESETS = ("random", "frequency", "empty")
"""What the pool holds at each request's start under a per-request reset: C experts drawn at random
(seeded), the C used most in the training split, or nothing."""


def reset_starts(kind: str, *, capacity: int, num_uids: int, seed: int, frequency: list[int]):
    """The start placement of each request in turn under a per-request reset of `kind` (`RESETS`):
    a callable of the request index. `frequency`: the training split's C most used uids."""
    if kind not in RESETS:
        raise UserError(f"--reset must be one of {', '.join(RESETS)}, got {kind!r}")
    rng = np.random.default_rng(seed)
    if kind == "random":
        return lambda r: np.sort(rng.choice(num_uids, size=capacity, replace=False)).tolist()
    return lambda r: list(frequency) if kind == "frequency" else []

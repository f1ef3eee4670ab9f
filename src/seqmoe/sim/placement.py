"""The start placement every system shares: the C experts used most often in the training split."""

from __future__ import annotations

import numpy as np

from seqmoe.errors import UserError
from seqmoe.trace.schema import RoutingTrace


def check_residency(residency: float) -> None:
    """UserError unless 0 < residency <= 1."""
    if not 0.0 < residency <= 1.0:
        raise UserError(f"residency must be in (0, 1], got {residency}")


def capacity_for(residency: float, num_layers: int, num_experts: int) -> int:
    """C = floor(r * L * E) slots for residency r in (0, 1]."""
    check_residency(residency)
    return int(np.floor(residency * num_layers * num_experts + 1e-9))


def uid_counts(trace: RoutingTrace) -> np.ndarray:
    """[L * E] int64: how often each global expert id is used in `trace`."""
    return np.bincount(trace.uids().reshape(-1), minlength=trace.num_layers * trace.num_experts)


def start_placement(train: RoutingTrace, capacity: int) -> list[int]:
    """The `capacity` uids used most often in `train`, most used first, ties by lower uid."""
    counts = uid_counts(train)
    order = np.lexsort((np.arange(len(counts)), -counts))
    return order[:capacity].tolist()

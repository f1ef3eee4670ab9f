"""Split a trace by request into train and test parts (predictors are judged on unseen prompts).

    train, test = split_trace(trace, test_fraction=0.1, seed=0)

The split is a seeded permutation of request indices, so the same seed gives the same split on
any machine; both parts keep the requests in their original order.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from seqmoe.trace.schema import RoutingTrace, TraceError


def split_trace(
    trace: RoutingTrace,
    test_fraction: float | None = None,
    num_test: int | None = None,
    seed: int = 0,
) -> tuple[RoutingTrace, RoutingTrace]:
    """Split `trace` into (train, test) by whole requests.

    Args:
        trace: the trace to split (R requests).
        test_fraction: share of requests for the test part, in (0, 1); rounded to
            round(test_fraction * R) requests. Give this or `num_test`, not both.
        num_test: number of test requests, in [1, R - 1].
        seed: seed of the permutation that picks the test requests.

    Returns:
        (train, test), each in original request order. per-request lists in `meta.extra`
        (`request_names`, keys ending in `_per_request`) are cut to match, and
        `meta.extra["split"]` records part, seed and sizes.

    Raises:
        TraceError: both or neither of test_fraction / num_test, a fraction outside (0, 1), or a
            split that would leave a part without requests.
    """
    R = trace.num_requests
    if (test_fraction is None) == (num_test is None):
        raise TraceError("give exactly one of test_fraction and num_test")
    if test_fraction is not None:
        if not 0.0 < test_fraction < 1.0:
            raise TraceError(f"test fraction must be between 0 and 1 (exclusive), got {test_fraction}")
        num_test = round(test_fraction * R)
        asked = f"test fraction {test_fraction} of {R} requests gives {num_test} test requests"
    else:
        asked = f"{num_test} test requests out of {R}"
    if not 0 < num_test < R:
        raise TraceError(f"{asked}; each part needs at least one request (the trace has {R})")
    perm = np.random.default_rng(seed).permutation(R)
    is_test = np.zeros(R, dtype=bool)
    is_test[perm[:num_test]] = True
    split = {"seed": seed, "num_train": R - num_test, "num_test": num_test}
    train = _part(trace, np.flatnonzero(~is_test), {"part": "train", **split})
    test = _part(trace, np.flatnonzero(is_test), {"part": "test", **split})
    return train, test


def _part(trace: RoutingTrace, requests: np.ndarray, split: dict) -> RoutingTrace:
    """The requests (ascending indices) as a new trace, with meta.extra updated to match."""
    part = trace.select_requests(requests)
    extra = dict(trace.meta.extra)
    for key, value in trace.meta.extra.items():
        # Per-request lists (request_names, dropped_rows_per_request, ...) follow their requests.
        per_request = key == "request_names" or key.endswith("_per_request")
        if per_request and isinstance(value, list) and len(value) == trace.num_requests:
            extra[key] = [value[r] for r in requests]
    extra["split"] = split
    return dataclasses.replace(part, meta=dataclasses.replace(trace.meta, extra=extra))

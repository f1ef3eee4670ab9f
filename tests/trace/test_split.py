"""Request-level train/test split: determinism, partition, order, errors.

Run: .venv/bin/pytest tests/trace/test_split.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqmoe.trace.schema import RoutingTrace, TraceError, TraceMeta
from seqmoe.trace.split import split_trace


def make(lengths, with_tokens=True) -> RoutingTrace:
    """Requests of the given lengths; token_ids number tokens 0..T-1 so parts can be traced back."""
    T = sum(lengths)
    ids = np.stack([np.arange(T) % 4, (np.arange(T) + 1) % 4], axis=1)[:, None, :].astype(np.int16)  # [T, 1, 2]
    R = len(lengths)
    extra = {"request_names": [f"r{i}" for i in range(R)], "x_per_request": list(range(R)), "note": "keep"}
    return RoutingTrace(
        expert_ids=ids,
        request_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        meta=TraceMeta(num_experts=4, extra=extra),
        token_ids=np.arange(T, dtype=np.int32) if with_tokens else None,
    )


def request_starts(part: RoutingTrace) -> list[int]:
    """Original index of each request's first token."""
    return part.token_ids[part.request_offsets[:-1]].tolist()


def test_split_by_count():
    trace = make([2, 3, 1, 4, 2])
    train, test = split_trace(trace, num_test=2, seed=0)
    assert train.num_requests == 3 and test.num_requests == 2
    assert train.num_tokens + test.num_tokens == trace.num_tokens
    names = train.meta.extra["request_names"] + test.meta.extra["request_names"]
    assert sorted(names) == [f"r{i}" for i in range(5)]
    assert train.meta.extra["request_names"] == sorted(train.meta.extra["request_names"])  # original order
    assert test.meta.extra["x_per_request"] == [int(n[1:]) for n in test.meta.extra["request_names"]]
    assert test.meta.extra["split"] == {"part": "test", "seed": 0, "num_train": 3, "num_test": 2}
    assert train.meta.extra["note"] == "keep"
    assert trace.meta.extra["request_names"] == [f"r{i}" for i in range(5)]  # input untouched


def test_split_is_deterministic_and_seeded():
    trace = make([1] * 40)
    a = split_trace(trace, test_fraction=0.25, seed=3)[1]
    b = split_trace(trace, test_fraction=0.25, seed=3)[1]
    c = split_trace(trace, test_fraction=0.25, seed=4)[1]
    assert a.num_requests == 10
    assert request_starts(a) == request_starts(b) != request_starts(c)


def test_fraction_rounds():
    assert split_trace(make([1] * 10), test_fraction=0.26)[1].num_requests == 3


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"test_fraction": 0.0}, "between 0 and 1"),
        ({"test_fraction": 1.0}, "between 0 and 1"),
        ({"test_fraction": -0.5}, "between 0 and 1"),
        ({"test_fraction": 0.01}, "gives 0 test requests; each part needs at least one"),
        ({"test_fraction": 0.95}, "gives 4 test requests; each part needs at least one"),
        ({"num_test": 0}, "0 test requests out of 4; each part needs at least one"),
        ({"num_test": 4}, "4 test requests out of 4"),
        ({}, "exactly one of"),
        ({"test_fraction": 0.5, "num_test": 1}, "exactly one of"),
    ],
)
def test_split_errors(kw, message):
    with pytest.raises(TraceError, match=message):
        split_trace(make([1, 2, 3, 4]), **kw)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 5), min_size=2, max_size=20), data=st.data())
def test_split_partitions_requests(lengths, data):
    trace = make(lengths)
    num_test = data.draw(st.integers(1, len(lengths) - 1))
    train, test = split_trace(trace, num_test=num_test, seed=data.draw(st.integers(0, 1000)))
    starts_train, starts_test = request_starts(train), request_starts(test)
    assert starts_train == sorted(starts_train) and starts_test == sorted(starts_test)
    all_starts = trace.request_offsets[:-1].tolist()
    assert sorted(starts_train + starts_test) == all_starts
    for part in (train, test):  # every request comes across whole
        for r in range(part.num_requests):
            lo, hi = part.request_offsets[r : r + 2]
            tokens = part.token_ids[lo:hi]
            np.testing.assert_array_equal(tokens, np.arange(tokens[0], tokens[0] + hi - lo))
            np.testing.assert_array_equal(part.expert_ids[lo:hi], trace.expert_ids[tokens])

"""RoutingTrace validation and helpers.

Run: .venv/bin/pytest tests/trace/test_schema.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from seqmoe.base.errors import UserError
from seqmoe.trace.schema import RoutingTrace, TraceError, TraceMeta


def make(ids, offsets=None, num_experts=4, **kw) -> RoutingTrace:
    ids = np.asarray(ids, dtype=np.int16)
    offsets = np.array([0, len(ids)] if offsets is None else offsets, dtype=np.int64)
    return RoutingTrace(expert_ids=ids, request_offsets=offsets, meta=TraceMeta(num_experts=num_experts), **kw)


# [T=3, L=2, K=2]
IDS = [[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[3, 2], [1, 0]]]


def test_valid_trace_and_properties():
    t = make(IDS, [0, 1, 3])
    assert (t.num_tokens, t.num_layers, t.top_k, t.num_experts, t.num_requests) == (3, 2, 2, 4, 2)
    assert t.request_ids().tolist() == [0, 1, 1]
    assert t.uids()[1, 1].tolist() == [4 + 3, 4 + 0]


def test_trace_error_is_user_error():
    assert issubclass(TraceError, UserError)


def test_out_of_range_id():
    ids = np.array(IDS)
    ids[2, 1, 0] = 4
    with pytest.raises(TraceError, match=r"expert id 4 out of range \[0, 4\) at token 2, layer 1, slot 0"):
        make(ids)


def test_negative_id():
    ids = np.array(IDS)
    ids[0, 0, 1] = -1
    with pytest.raises(TraceError, match="out of range"):
        make(ids)


def test_duplicate_id_in_token_layer():
    ids = np.array(IDS)
    ids[1, 0] = [2, 2]
    with pytest.raises(TraceError, match="token 1, layer 0 lists an expert twice"):
        make(ids)


def test_empty_request():
    with pytest.raises(TraceError, match="request 1 is empty"):
        make(IDS, [0, 1, 1, 3])


@pytest.mark.parametrize("offsets", [[0, 2], [1, 3], [0, 4], [0]])
def test_bad_offsets(offsets):
    with pytest.raises(TraceError, match="request_offsets must run from 0 to T=3"):
        make(IDS, offsets)


def test_decreasing_offsets():
    with pytest.raises(TraceError, match="empty"):
        make(IDS, [0, 2, 1, 3])


def test_bad_shapes():
    with pytest.raises(TraceError, match=r"\[T, L, K\]"):
        make(np.zeros((3, 2), dtype=np.int16))
    with pytest.raises(TraceError, match="empty dimension"):
        make(np.zeros((0, 2, 2), dtype=np.int16), [0, 0])
    with pytest.raises(TraceError, match="gate_weights shape"):
        make(IDS, gate_weights=np.zeros((3, 2, 1), dtype=np.float32))
    with pytest.raises(TraceError, match="token_ids shape"):
        make(IDS, token_ids=np.zeros(2, dtype=np.int32))
    with pytest.raises(TraceError, match="outside vocab"):
        make(IDS, token_ids=np.array([0, 1, 2], dtype=np.int32), vocab=("a", "b"))


def test_select_requests_and_head():
    t = make(IDS, [0, 1, 3], token_ids=np.array([5, 6, 7], dtype=np.int32))
    sel = t.select_requests([1, 0])
    assert sel.request_offsets.tolist() == [0, 2, 3]
    assert sel.token_ids.tolist() == [6, 7, 5]
    assert t.head(2).request_offsets.tolist() == [0, 1, 2]
    with pytest.raises(TraceError, match="zero requests"):
        t.select_requests([])

"""The optional `pregate_logits` field of RoutingTrace: validation, slicing and save/load."""

from __future__ import annotations

import numpy as np
import pytest

from seqmoe.trace.io import load_trace, save_trace
from seqmoe.trace.schema import RoutingTrace, TraceError
from tests.conftest import make_trace


def _with_pregate(trace: RoutingTrace, H: int = 2) -> RoutingTrace:
    rng = np.random.default_rng(0)
    pre = rng.normal(size=(trace.num_tokens, trace.num_layers, H, trace.num_experts)).astype(np.float16)
    pre[:, -1] = np.nan
    return RoutingTrace(expert_ids=trace.expert_ids, request_offsets=trace.request_offsets, meta=trace.meta,
                        pregate_logits=pre)


def test_round_trip_and_slicing(tmp_path):
    trace = _with_pregate(make_trace())
    save_trace(trace, tmp_path / "t.safetensors")
    back = load_trace(tmp_path / "t.safetensors")
    assert back.pregate_logits.dtype == np.float16
    np.testing.assert_array_equal(back.pregate_logits, trace.pregate_logits)  # NaN == NaN here
    part = trace.select_requests([2, 0])
    off = trace.request_offsets
    np.testing.assert_array_equal(part.pregate_logits[: off[3] - off[2]], trace.pregate_logits[off[2] : off[3]])
    assert trace.head(7).pregate_logits.shape == (7, 3, 2, 8)
    assert load_trace(tmp_path / "t.safetensors").gate_weights is None


@pytest.mark.parametrize("shape", [(120, 3, 2), (120, 2, 2, 8), (120, 3, 2, 7), (119, 3, 2, 8), (120, 3, 0, 8)])
def test_bad_shapes_are_rejected(shape):
    trace = make_trace()
    with pytest.raises(TraceError, match="pregate_logits"):
        RoutingTrace(expert_ids=trace.expert_ids, request_offsets=trace.request_offsets, meta=trace.meta,
                     pregate_logits=np.zeros(shape, dtype=np.float16))

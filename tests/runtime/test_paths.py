"""The experts wrapper's two data paths: in place from a window of pool slots, or gathered.

Run: pytest tests/runtime/test_paths.py -q
"""

from __future__ import annotations

import pytest
import torch

from seqmoe.runtime import offload
from seqmoe.runtime.core.experts import OffloadedExperts
from seqmoe.runtime.core.front import CPU_IN_PLACE_BYTES
from tests.runtime.conftest import fresh, greedy, logits, reference


def _experts(model) -> list[OffloadedExperts]:
    return [m for m in model.modules() if isinstance(m, OffloadedExperts)]


def _in_place(model, torch_table: bool = False) -> None:
    """Force the window path (small experts on the CPU are gathered by default); `torch_table`: look
    slots up with torch ops as on CUDA."""
    for e in _experts(model):
        assert e.front.slot_ok
        e.front.by_slot = True
        if torch_table:
            e.front._table_np = None


def test_small_cpu_experts_are_gathered_by_default():
    model = fresh("olmoe")
    rt = offload(model, 1.0, "on-demand-lru", train=reference("olmoe").train)
    assert not any(e.front.by_slot for e in _experts(model)) and rt.pool.expert_bytes < CPU_IN_PLACE_BYTES
    greedy(model)
    assert sum(e.gather_calls for e in _experts(model)) > 0
    rt.restore()


@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss", "deepseek_v3"])
def test_full_residency_reads_the_pool_in_place(arch):
    ref = reference(arch)
    model = fresh(arch)
    rt = offload(model, 1.0, "on-demand-lru", train=ref.train)
    _in_place(model)
    assert all(rt.pool.slot_of[u] == u for u in range(rt.capacity))  # home slots: slot = uid
    assert torch.equal(greedy(model), ref.tokens)
    assert torch.equal(logits(model), ref.logits)  # bit-identical
    ex = _experts(model)
    assert sum(e.gather_calls for e in ex) == 0 and sum(e.slot_calls for e in ex) > 0
    assert rt.pool.peak_gathered == 0 and rt.stats()["host_us_per_token"] > 0
    rt.restore()


@pytest.mark.parametrize("torch_table", [False, True])
def test_partial_residency_mixes_both_paths_exactly(torch_table):
    ref = reference("mixtral")
    model = fresh("mixtral")
    rt = offload(model, 0.5, "on-demand-lru")
    _in_place(model, torch_table)
    assert torch.equal(greedy(model), ref.tokens)
    assert (logits(model) - ref.logits).abs().max().item() <= 1e-5
    ex = _experts(model)
    assert sum(e.gather_calls for e in ex) > 0 and sum(e.slot_calls for e in ex) > 0
    rt.restore()


def test_eager_implementation_is_always_gathered_in_expert_order():
    """The eager forward adds experts in id order, so it never runs on renumbered slots."""
    ref = reference("qwen3_moe")
    model = fresh("qwen3_moe")
    model.config._experts_implementation = "eager"
    want_tokens, want_logits = greedy(model), logits(model)
    assert torch.equal(want_tokens, ref.tokens)
    rt = offload(model, 1.0, "on-demand-lru", train=ref.train)
    assert torch.equal(greedy(model), want_tokens)
    assert torch.equal(logits(model), want_logits)
    ex = _experts(model)
    assert not any(e.front.slot_ok or e.front.by_slot for e in ex) and sum(e.slot_calls for e in ex) == 0
    rt.restore()


def test_a_routed_index_beyond_the_experts_is_a_user_error():
    """One position is checked by the controller as its router reveals it; several by the wrapper."""
    import numpy as np

    from seqmoe.base.errors import UserError

    model = fresh("olmoe")
    rt = offload(model, 1.0, "on-demand-lru", train=reference("olmoe").train)
    _in_place(model)
    with pytest.raises(UserError, match="expert parallelism"):
        _experts(model)[0](torch.zeros(2, 32), torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2))
    rt.controller.begin_forward([5], False)
    with pytest.raises(UserError, match="expert parallelism"):
        rt.controller.route(0, np.array([[0, 8]]), np.ones((1, 2), np.float32))
    rt.controller.end_forward()
    assert torch.equal(greedy(model), reference("olmoe").tokens)  # still usable
    rt.restore()

"""Memory invariants: the device holds at most C experts, the host holds each expert once.

Run: pytest tests/runtime/test_memory.py -q
"""

from __future__ import annotations

import pytest
import torch

from seqmoe.arch.collect import moe_layers
from seqmoe.runtime import offload
from seqmoe.runtime.core.experts import OffloadedExperts
from tests.runtime.conftest import fresh, greedy


def _expert_params(model):
    layers = moe_layers(model)
    out = []
    for m in layers:
        out += list(m.experts.parameters(recurse=False))
    return out


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_experts_live_once_on_the_host_and_at_most_C_on_the_device(arch):
    model = fresh(arch)
    layers = moe_layers(model)
    L, E = len(layers), layers[0].num_experts
    routed = _expert_params(model)
    routed_bytes = sum(p.numel() * p.element_size() for p in routed)
    total_before = sum(p.numel() * p.element_size() for p in model.parameters())
    del routed
    rt = offload(model, 0.25, "on-demand-lru")
    greedy(model)
    rt.synchronize()
    s = rt.stats()
    C, eb = rt.capacity, s["expert_bytes"]
    assert C == int(0.25 * L * E)
    # Device side: the pool is the only tensor with expert weights, and it is C slots.
    pool = rt.pool.pool
    assert pool.shape[0] == C and pool.numel() * pool.element_size() == C * eb == s["device_expert_bytes"]
    assert s["device_expert_bytes"] <= s["device_expert_bytes_limit"]
    assert len(rt.pool.resident()) <= C
    # The model kept everything but the routed experts; no experts module holds parameters.
    total_after = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total_after == total_before - routed_bytes
    for m in layers:
        experts = m.experts
        assert isinstance(experts, OffloadedExperts)
        assert not list(experts.parameters()) and not list(experts.original.parameters(recurse=False))
    # Host side: one packed copy of every expert, sharing no memory with the model or the pool.
    assert s["host_expert_bytes"] == routed_bytes == L * E * eb
    hosts = _storages(rt.pool.hosts)
    assert len(hosts) == L
    assert not hosts & _storages(list(model.parameters()) + list(model.buffers()) + [pool])
    rt.restore()


def test_stats_report_the_pool_and_the_counts():
    model = fresh("olmoe")
    rt = offload(model, 0.5, "on-demand-lfu")
    greedy(model)
    s = rt.stats()
    for key in ("hit_rate", "ready", "late", "misses", "ready_rate", "late_rate", "miss_rate", "copies",
                "bytes_copied", "device_expert_bytes", "host_expert_bytes", "capacity"):
        assert key in s
    assert s["tokens"] == 6 + 7 and s["activations"] == s["tokens"] * s["num_layers"] * s["top_k"]
    assert s["hit_rate"] == pytest.approx(s["ready_rate"] + s["late_rate"])
    assert s["pool_reads"] + s["host_reads"] > 0
    rt.restore()


def test_every_expert_read_comes_from_the_pool_at_full_residency():
    from tests.runtime.conftest import reference

    model = fresh("mixtral")
    rt = offload(model, 1.0, "on-demand-lru", train=reference("mixtral").train)
    assert len(rt.start) == rt.capacity == 24
    greedy(model)
    s = rt.stats()
    assert s["host_reads"] == 0 and s["misses"] == 0 and s["copies"] == 0
    rt.restore()


def test_parameters_hold_no_memory_while_offloaded_and_come_back_as_they_were():
    model = fresh("mixtral")
    experts = moe_layers(model)[0].experts
    param = experts.gate_up_proj
    before, grad = param.detach().clone(), param.requires_grad
    rt = offload(model, 0.5, "on-demand-lru")
    assert param.untyped_storage().nbytes() == 0  # its data was freed: the host block is the only copy
    rt.restore()
    assert experts.gate_up_proj is param and param.requires_grad == grad and torch.equal(param, before)

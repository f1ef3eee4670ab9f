"""The offloaded model computes exactly what the full model computes, for every live system.

Greedy tokens must be equal and logits within 1e-5 (fp32, CPU; in practice they are bit-identical)
for each architecture, residency and system. Run: pytest tests/runtime/test_exact.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from seqmoe.arch.collect import moe_layers
from seqmoe.brain.manager.systems import live_systems
from seqmoe.runtime import offload
from tests.arch.collect.tiny_models import ARCHS
from tests.runtime.conftest import TEST_HW, fresh, greedy, logits, reference

RESIDENCIES = (0.1, 0.5, 1.0)


def _clamped(residency: float, model) -> float:
    """Raise `residency` to the fewest slots offload accepts, top-k (qwen2_moe's 2x8 experts at 0.1 give 1 slot)."""
    layers = moe_layers(model)
    return max(residency, layers[0].top_k / (len(layers) * layers[0].num_experts))


@pytest.mark.parametrize("control", ["inline", "thread"])
@pytest.mark.parametrize("residency", RESIDENCIES)
@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_model_matches_full_model(arch, residency, control):
    ref = reference(arch)
    for system in live_systems():
        model = fresh(arch)
        rt = offload(model, _clamped(residency, model), system, train=ref.train, hardware=TEST_HW,
                     control=control)
        out = greedy(model)
        assert torch.equal(out, ref.tokens), f"{arch} {system} r={residency}: {out.tolist()} != {ref.tokens.tolist()}"
        diff = (logits(model) - ref.logits).abs().max().item()
        assert diff <= 1e-5, f"{arch} {system} r={residency}: logits differ by {diff}"
        s = rt.stats()
        assert s["device_expert_bytes"] <= s["capacity"] * s["expert_bytes"]
        assert s["activations"] == s["ready"] + s["late"] + s["misses"] > 0
        rt.synchronize()
        # Once the copies have run, the published slots are exactly the simulator's present set.
        assert rt.pool.resident() == set(np.flatnonzero(rt.controller.state.present_mask()).tolist())
        assert len(rt.pool.resident()) <= rt.capacity
        rt.restore()


@pytest.mark.parametrize("control", ["inline", "thread"])
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_exact_without_train_and_with_a_slow_emulated_link(arch, control):
    """Empty start pool; the worker lags far behind the model (copies land mid-run, some are skipped)."""
    ref = reference(arch)
    for system in live_systems(with_train=False):
        model = fresh(arch)
        rt = offload(model, 0.3, system, hardware=TEST_HW, bandwidth=2e7, emulate_link=True, control=control)
        assert torch.equal(greedy(model), ref.tokens), system
        assert (logits(model) - ref.logits).abs().max().item() <= 1e-5, system
        assert rt.stats()["host_reads"] > 0  # misses were computed from the host blocks
        rt.restore()


def test_restore_gives_the_original_model_back():
    ref = reference("deepseek_v3")
    model = fresh("deepseek_v3")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = offload(model, 0.5, "on-demand-lru")
    greedy(model)
    rt.restore()
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert torch.equal(greedy(model), ref.tokens)
    rt2 = offload(model, 0.5, "on-demand-lru")  # and it can be offloaded again
    assert torch.equal(greedy(model), ref.tokens)
    rt2.restore()

"""The twin miss path live (`offload(..., twin="int4")`): a miss its twin serves is computed from
the twin's weights, which are exactly `quantize_experts`' at that precision; with no budget the
path changes nothing; the data plane reads what the control plane decided.

Run: pytest tests/runtime/test_twins.py -q
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from seqmoe.arch import cache_kwarg, model_arch
from seqmoe.arch.quant import QuantLayout, quantize_experts
from seqmoe.base.errors import UserError
from seqmoe.runtime import offload
from tests.runtime.conftest import LOGITS_INPUT, fresh, greedy, reference

ARCHS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")
EVERY_MISS = 1e9
"""A twin budget no token spends: every miss is served by its twin."""


def _stepwise(model, ids=LOGITS_INPUT) -> torch.Tensor:
    """[n, V] logits of `ids` [n] (or [B, n, V] of B rows [B, n]) fed one position per forward (every
    position a decode step: a prompt forward computes each expert where it is, twins aside)."""
    ids = torch.as_tensor(ids)
    rows = ids.view(-1, ids.shape[-1])
    key, cache, out = cache_kwarg(model), DynamicCache(config=model.config), []
    with torch.no_grad():
        for t in range(rows.shape[1]):
            out.append(model(rows[:, t:t + 1], use_cache=True, **{key: cache}).logits[:, -1])
    got = torch.stack(out, 1)
    return got[0] if ids.ndim == 1 else got


@pytest.mark.parametrize("control", ["inline", "thread"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_position_whose_every_miss_reads_its_twin_computes_the_quantized_model(arch, control):
    """No start placement and no copy (every miss goes to its twin): each decode step computes all
    its experts from int4 twins, which is what the int4-quantized full model computes. On the posted
    engine the decision comes through the host relay and the twin rows are read on the device."""
    want = _stepwise(quantize_experts(fresh(arch), "int4"))
    model = fresh(arch)
    rt = offload(model, 0.3, "on-demand-lru", miss="copy", twin="int4", twin_budget=EVERY_MISS, control=control)
    got = _stepwise(model)
    s = rt.stats()
    rt.restore()
    assert (got - want).abs().max().item() <= 1e-4
    assert s["misses_twin"] == s["misses"] == s["twin_reads"] > 0 and s["sim_copies"] == 0
    assert torch.equal(greedy(model), reference(arch).tokens)  # restore gives the model back whole


@pytest.mark.parametrize("control", ["inline", "thread"])
def test_a_batch_step_reads_the_twins_of_its_rows_misses(control):
    """Three rows decoded together, every miss to its twin: each row's logits are the int4-quantized
    model's, and a twin two rows need is read once."""
    one = torch.as_tensor(LOGITS_INPUT)
    ids = torch.stack([one, one.flip(0), (one * 7) % 100])
    want = _stepwise(quantize_experts(fresh("mixtral"), "int4"), ids)
    model = fresh("mixtral")
    rt = offload(model, 0.3, "on-demand-lru", miss="copy", twin="int4", twin_budget=EVERY_MISS, control=control)
    got = _stepwise(model, ids)
    s = rt.stats()
    rt.restore()
    assert (got - want).abs().max().item() <= 1e-4
    assert 0 < s["twin_reads"] == s["misses_twin"] < s["misses"]  # misses count per row, a twin is read once


@pytest.mark.parametrize("miss", ["copy", "auto"])
def test_a_zero_budget_changes_nothing(miss):
    runs = []
    for twin in (None, "int4"):
        model = fresh("olmoe")
        rt = offload(model, 0.3, "on-demand-lru", miss=miss, twin=twin, twin_budget=0.0 if twin else None)
        runs.append((_stepwise(model), rt.stats()))
        rt.restore()
    (plain, s0), (zero, s1) = runs
    assert torch.equal(plain, zero)
    assert s1["misses_twin"] == s1["twin_reads"] == 0 and s1["misses"] == s0["misses"] > 0


def test_the_twins_serve_the_misses_the_manager_gave_them_within_the_budget():
    model = fresh("mixtral")
    rt = offload(model, 0.3, "on-demand-lru", miss="auto", twin="int4", twin_budget=0.3)
    _stepwise(model, LOGITS_INPUT * 3)
    s = rt.stats()
    rt.restore()
    layout = QuantLayout.of(model_arch(model).layout(model_arch(model).moe[0].experts), "int4")
    assert 0 < s["misses_twin"] == s["twin_reads"] < s["misses"]
    assert 0 < s["twin_weight_per_token"] <= 0.3
    assert s["twin"] == "int4" and s["host_twin_bytes"] == s["num_layers"] * s["num_experts"] * layout.numel


def test_bad_twins_are_user_errors_and_change_nothing():
    model = fresh("olmoe")
    for options, says in (({"twin": "int4", "expert_dtype": "int4"}, "not smaller"),
                          ({"twin_budget": 0.5}, "give its precision")):
        with pytest.raises(UserError, match=says):
            offload(model, 0.3, "on-demand-lru", **options)
    assert torch.equal(greedy(model), reference("olmoe").tokens)

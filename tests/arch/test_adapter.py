"""The architecture adapter finds every supported family's MoE parts, and says clearly when it cannot.

Run: pytest tests/arch -q
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from seqmoe.arch import FAMILIES, GENERIC, model_arch, unpack_router_output
from seqmoe.base.errors import UserError
from tests.arch.collect.tiny_models import ARCHS, tiny_dense_model, tiny_model

MOE_LAYERS = {"qwen2_moe": [0, 2], "deepseek_v2": [1, 2, 3], "deepseek_v3": [1, 2, 3]}
"""Decoder layers that are MoE in the tiny configs (mlp_only_layers, first_k_dense_replace); else all 3."""
ROUTER_ATTR = {"gpt_oss": "router"}
SRC = Path(__file__).resolve().parents[2] / "src" / "seqmoe"


def _as_unknown(model):
    """The same model under a model type no family lists (instance attribute only)."""
    model.config.model_type = "some_new_moe"
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_finds_blocks_routers_experts_and_E_K(arch):
    model = tiny_model(arch)
    found = model_arch(model)
    assert found.family.name == arch and found.layers_name == "model.layers" and found.decoder is model.model.layers
    assert [m.layer_index for m in found.moe] == MOE_LAYERS.get(arch, [0, 1, 2])
    assert (found.num_experts, found.top_k) == (8, 2)
    for m in found.moe:
        block = model.model.layers[m.layer_index].mlp
        router = getattr(block, ROUTER_ATTR.get(arch, "gate"))
        assert m.block is block and m.router is router and m.experts is block.experts
        assert m.name == f"model.layers.{m.layer_index}.mlp.{ROUTER_ATTR.get(arch, 'gate')}"
        assert model.get_submodule(m.block_name) is block
        assert router.weight.shape[0] == 8
        _, w, ids = unpack_router_output(router, router(torch.randn(5, 32)))
        assert ids.shape == w.shape == (5, 2) and int(ids.max()) < 8


@pytest.mark.parametrize("arch", ARCHS)
def test_the_generic_search_agrees_with_the_family_entry(arch):
    """An unknown v5 model type laid out like the families still works (today's behaviour)."""
    want = model_arch(tiny_model(arch))
    got = model_arch(_as_unknown(tiny_model(arch)))
    assert got.family is GENERIC
    assert [(m.layer_index, m.name, m.block_name, m.num_experts, m.top_k) for m in got.moe] == \
        [(m.layer_index, m.name, m.block_name, m.num_experts, m.top_k) for m in want.moe]
    assert got.param_names(got.moe[0].experts) == want.param_names(want.moe[0].experts)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_expert_layout_round_trips(arch):
    model = tiny_model(arch)
    found = model_arch(model)
    experts = found.moe[-1].experts
    before = {n: p.detach().clone() for n, p in experts.named_parameters(recurse=False)}
    layout = found.layout(experts)
    assert set(layout.names) == set(before) and layout.numel == sum(p[0].numel() for p in before.values())
    host = torch.empty((8, layout.numel), dtype=layout.dtype)
    layout.pack(experts, host)
    for name, view in layout.views(host[[5, 2]]).items():  # any rows: the experts' own slices
        assert torch.equal(view, before[name][[5, 2]])
    params = dict(experts.named_parameters(recurse=False))
    kept = layout.strip(experts)
    assert not list(experts.parameters(recurse=False)) and all(p.numel() == 0 for p in kept.values())
    layout.unpack(experts, host, torch.device("cpu"), kept)
    after = dict(experts.named_parameters(recurse=False))
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
    assert all(after[n] is params[n] for n in params)  # the same Parameter objects, refilled


def test_seqmoe_tiny_is_an_olmoe():
    from seqmoe.arch.collect import load_model

    model, _ = load_model("seqmoe-tiny", device="cpu", tokenizer=False)
    found = model_arch(model)
    assert (found.family.name, len(found.moe), found.num_experts, found.top_k) == ("olmoe", 8, 32, 4)


def test_a_dense_model_names_the_supported_families():
    with pytest.raises(UserError, match="no MoE layers") as err:
        model_arch(tiny_dense_model())
    assert all(f.name in str(err.value) for f in FAMILIES) and "Adding a model architecture" in str(err.value)


def test_a_known_family_laid_out_unlike_its_entry_is_a_user_error():
    model = tiny_model("mixtral")
    experts = model_arch(model).moe[0].experts
    experts.register_parameter("down_proj_scale", torch.nn.Parameter(torch.ones(8, 32)))  # e.g. a quantised layout
    with pytest.raises(UserError, match=r"should hold the stacked parameters gate_up_proj, down_proj .*down_proj_scale"):
        model_arch(model).layout(experts)
    del model.model.layers[1].mlp.experts
    with pytest.raises(UserError, match="has a router but no `experts` module"):
        model_arch(model)
    model = tiny_model("gpt_oss")
    model.model.layers = torch.nn.ModuleList()  # no decoder layers where the family keeps them
    with pytest.raises(UserError, match="no decoder layers at `model.layers`"):
        model_arch(model)


def test_collect_and_runtime_hold_no_architecture_knowledge():
    """Where routers, experts and their parameters are is the adapter's alone (src/seqmoe/arch)."""
    pattern = re.compile(r"gate_up_proj|down_proj|num_local_experts|n_routed_experts|num_experts_per_tok|"
                         r"named_modules|has_gate|_experts_implementation|model\.layers|\wRouter\b")
    hits = [f"{p.relative_to(SRC)}:{i}" for d in ("collect", "runtime") for p in sorted((SRC / d).glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_the_cache_argument_follows_the_installed_transformers():
    import inspect
    import warnings

    from seqmoe.arch import cache_kwarg
    from seqmoe.runtime import DecodeGraph, offload
    from tests.runtime.conftest import PROMPT

    class Old(torch.nn.Module):  # transformers before the rename (5.13 - 5.21)
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    model = tiny_model("olmoe")
    assert cache_kwarg(Old()) == "past_key_values"
    assert cache_kwarg(model) == ("cache" if "cache" in inspect.signature(model.forward).parameters
                                  else "past_key_values")
    rt = offload(model, 0.5, control="thread")
    assert cache_kwarg(model) == cache_kwarg(tiny_model("olmoe"))  # through the runtime's forward guard
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        DecodeGraph(rt, 32).generate(torch.tensor([PROMPT]), 4)
    assert not [w for w in seen if "past_key_values" in str(w.message)]
    rt.restore()

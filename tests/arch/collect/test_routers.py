"""The recorded routing is what the router computes and what the MoE block uses, for every architecture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from seqmoe.arch.collect import collect_trace, moe_layers
from seqmoe.base.errors import UserError
from tests.arch.collect.tiny_models import ARCHS, tiny_dense_model, tiny_model

TOKENS = [[1, *range(5, 40, 2)], [1, 70, 71, 9, 100, 3]]


def reference_routing(arch: str, router: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) [N, K] computed from the router's parameters, independently of its forward."""
    x = x.reshape(-1, x.shape[-1]).float()
    logits = x @ router.weight.float().T
    K = router.top_k
    if arch == "gpt_oss":
        top, ids = torch.topk(logits + router.bias, K)
        return ids, torch.softmax(top, dim=-1)
    if arch.startswith("deepseek"):
        E, G = router.num_experts, router.num_group
        scores = torch.softmax(logits, -1) if arch == "deepseek_v2" else torch.sigmoid(logits)
        choice = scores if arch == "deepseek_v2" else scores + router.e_score_correction_bias
        grouped = choice.view(-1, G, E // G)
        group_score = grouped.max(-1).values if arch == "deepseek_v2" else grouped.topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(router.topk_group, -1).indices, 1)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(E // G, dim=1), float("-inf"))
        ids = choice.topk(K, -1).indices
        w = scores.gather(1, ids)
        if arch == "deepseek_v3":
            w = w / w.sum(-1, keepdim=True)
        return ids, w * router.routed_scaling_factor
    probs = torch.softmax(logits, -1)
    w, ids = probs.topk(K, -1)
    if arch == "mixtral" or router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return ids, w


def _by_id(ids: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(w, order, -1)


def _capture(modules, store):
    """Hooks that append (input, output) of each module to store[i]."""

    def make(i):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            store[i].append((x.detach().clone(), output))

        return hook

    return [m.register_forward_hook(make(i), with_kwargs=True) for i, m in enumerate(modules)]


def test_moe_layers_skip_dense_layers():
    assert [m.layer_index for m in moe_layers(tiny_model("deepseek_v3"))] == [1, 2, 3]  # first_k_dense_replace=1
    assert [m.layer_index for m in moe_layers(tiny_model("qwen2_moe"))] == [0, 2]  # mlp_only_layers=[1]
    layers = moe_layers(tiny_model("mixtral"))
    assert [(m.num_experts, m.top_k) for m in layers] == [(8, 2)] * 3
    assert layers[1].name == "model.layers.1.mlp.gate"
    with pytest.raises(UserError, match="no MoE layers"):
        moe_layers(tiny_dense_model())


@pytest.mark.parametrize("arch", ARCHS)
def test_ids_and_weights_match_reference_routing(arch):
    model = tiny_model(arch)
    layers = moe_layers(model)
    seen = [[] for _ in layers]
    handles = _capture([m.router for m in layers], seen)
    try:
        trace = collect_trace(model, TOKENS)
    finally:
        for h in handles:
            h.remove()
    assert trace.expert_ids.shape == (sum(map(len, TOKENS)), len(layers), 2)
    assert trace.meta.extra["moe_layers"] == [m.layer_index for m in layers]
    np.testing.assert_array_equal(trace.token_ids, np.concatenate(TOKENS))
    for l, layer in enumerate(layers):
        ref = [reference_routing(arch, layer.router, x) for x, _ in seen[l]]
        ref_ids = torch.cat([r[0] for r in ref]).numpy()
        ref_w = torch.cat([r[1] for r in ref]).detach().numpy()
        if arch.startswith("deepseek"):  # topk(sorted=False): compare as sets
            got_ids, got_w = _by_id(trace.expert_ids[:, l], trace.gate_weights[:, l])
            ref_ids, ref_w = _by_id(ref_ids, ref_w)
        else:  # the router's order: best first
            got_ids, got_w = trace.expert_ids[:, l], trace.gate_weights[:, l]
        np.testing.assert_array_equal(got_ids, ref_ids)
        np.testing.assert_allclose(got_w, ref_w, rtol=1e-4, atol=1e-5)


def _mixtral_experts(block, x, ids, w):
    """Mixtral's MoE output, summed by hand from the expert weight tensors."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, g in zip(ids[t].tolist(), w[t].tolist()):
            gate, up = (block.experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += g * (block.experts.down_proj[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe"])
def test_block_output_recomputed_from_recorded_routing(arch):
    model = tiny_model(arch)
    blocks = [model.model.layers[m.layer_index].mlp for m in moe_layers(model)]
    seen = [[] for _ in blocks]
    handles = _capture(blocks, seen)
    try:
        trace = collect_trace(model, TOKENS[:1])
    finally:
        for h in handles:
            h.remove()
    ids = torch.from_numpy(trace.expert_ids.astype(np.int64))
    w = torch.from_numpy(trace.gate_weights)
    with torch.no_grad():
        for l, block in enumerate(blocks):
            (x, out), = seen[l]
            x = x.reshape(-1, x.shape[-1])
            out = (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
            if arch == "mixtral":
                mine = _mixtral_experts(block, x, ids[:, l], w[:, l])
            else:
                mine = block.experts(x, ids[:, l], w[:, l])
            if arch.startswith("deepseek"):
                mine = mine + block.shared_experts(x)
            if arch == "qwen2_moe":
                mine = mine + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
            torch.testing.assert_close(mine, out, rtol=1e-4, atol=1e-5)
            # and another routing would not give the same output
            assert not torch.allclose(block.experts(x, (ids[:, l] + 1) % 8, w[:, l]), out, atol=1e-4)


def test_recorder_and_router_output_errors():
    from seqmoe.arch.collect.routers import RouterRecorder, unpack_router_output

    layers = moe_layers(tiny_model("olmoe"))
    with RouterRecorder(layers) as rec, pytest.raises(UserError, match="bypass the router"):
        rec.take()  # no forward ran: as if a fused kernel skipped the routers
    with pytest.raises(UserError, match="not supported"):
        unpack_router_output(torch.nn.Linear(4, 8), torch.zeros(3, 8))


def test_load_model_errors(tmp_path):
    from seqmoe.arch.collect import load_model

    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(UserError, match="cannot load a causal LM"):
        load_model(tmp_path)
    with pytest.raises(UserError, match="has no config.json"):
        load_model(tmp_path.parent)
    with pytest.raises(UserError, match="unknown dtype"):
        load_model(tmp_path, dtype="int3")

"""collect_trace: decode routing equals prompt routing, pre-gating, requests from text."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from seqmoe.arch.collect import collect_trace, moe_layers, tokenize
from seqmoe.arch.collect.collector import read_text_requests
from seqmoe.base.errors import UserError
from tests.arch.collect.tiny_models import ARCHS, tiny_model, tiny_tokenizer

PROMPTS = [[1, 17, 33, 50, 4, 90, 12], [1, 60, 61, 62]]
NEW = 6


def _sorted(trace):
    order = np.argsort(trace.expert_ids, axis=-1)
    return np.take_along_axis(trace.expert_ids, order, -1), np.take_along_axis(trace.gate_weights, order, -1)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_routing_equals_prompt_routing(arch):
    model = tiny_model(arch)
    decode = collect_trace(model, PROMPTS, mode="decode", new_tokens=NEW)
    off = decode.request_offsets
    assert decode.meta.extra["prompt_tokens"] == [len(p) for p in PROMPTS]
    for r, prompt in enumerate(PROMPTS):
        seq = decode.token_ids[off[r] : off[r + 1]]
        np.testing.assert_array_equal(seq[: len(prompt)], prompt)
        eos = model.config.eos_token_id
        assert len(seq) == len(prompt) + NEW or seq[-1] == eos  # all generated tokens are routed, the last too
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0]
        np.testing.assert_array_equal(seq, ref.numpy())  # greedy, so the recorded tokens are generate's
    # prompt-time forward over the generated sequences routes every position the same way
    prompt = collect_trace(model, [decode.token_ids[off[r] : off[r + 1]] for r in range(len(PROMPTS))])
    np.testing.assert_array_equal(prompt.request_offsets, decode.request_offsets)
    (ids_d, w_d), (ids_p, w_p) = _sorted(decode), _sorted(prompt)
    np.testing.assert_array_equal(ids_d, ids_p)
    np.testing.assert_allclose(w_d, w_p, rtol=1e-4, atol=1e-5)


def test_pregate_logits_are_later_routers_on_this_layers_input():
    model = tiny_model("mixtral")
    layers = moe_layers(model)
    inputs = [[] for _ in layers]
    hooks = [m.router.register_forward_hook(lambda mod, a, o, l=l: inputs[l].append(a[0].detach()))
             for l, m in enumerate(layers)]
    try:
        trace = collect_trace(model, PROMPTS[:1], pregate=2)
    finally:
        for h in hooks:
            h.remove()
    pre = trace.pregate_logits
    L = len(layers)
    assert pre.shape == (len(PROMPTS[0]), L, 2, 8) and pre.dtype == np.float16
    for l in range(L):
        x = inputs[l][0].reshape(-1, 32)  # one call per layer: the routers' own hooks saw no pre-gating calls
        assert len(inputs[l]) == 1
        for h in (1, 2):
            if l + h < L:
                want = (x @ layers[l + h].router.weight.T).detach().numpy()
                np.testing.assert_allclose(pre[:, l, h - 1].astype(np.float32), want, rtol=2e-3, atol=2e-3)
            else:
                assert np.isnan(pre[:, l, h - 1]).all()


def test_pregate_with_a_copied_router_predicts_the_recorded_routing():
    """If layer 1's router equals layer 0's, layer 0's horizon-1 scores pick exactly layer 0's experts."""
    model = tiny_model("olmoe")
    layers = moe_layers(model)
    with torch.no_grad():
        layers[1].router.weight.copy_(layers[0].router.weight)
    trace = collect_trace(model, PROMPTS, pregate=1)
    guess = np.argsort(-trace.pregate_logits[:, 0, 0].astype(np.float32), axis=-1)[:, :2]
    np.testing.assert_array_equal(np.sort(guess, -1), np.sort(trace.expert_ids[:, 0], -1))
    assert not np.array_equal(np.sort(guess, -1), np.sort(trace.expert_ids[:, 1], -1))


def test_pregate_in_decode_mode_matches_prompt_mode():
    model = tiny_model("deepseek_v3")
    decode = collect_trace(model, PROMPTS[:1], mode="decode", new_tokens=4, pregate=1)
    prompt = collect_trace(model, [decode.token_ids], pregate=1)
    np.testing.assert_allclose(decode.pregate_logits.astype(np.float32), prompt.pregate_logits.astype(np.float32),
                               rtol=2e-3, atol=2e-3)


def test_texts_are_tokenized_and_labelled():
    model, tok = tiny_model("qwen3_moe"), tiny_tokenizer()
    trace = collect_trace(model, ["Hello world.", "", "Bye."], tok, labels=["a", "b", "c"], max_tokens=5,
                          model_name="tiny-qwen3")
    assert trace.num_requests == 2 and trace.meta.extra["requests"] == ["a", "c"]  # the empty one is skipped
    np.testing.assert_array_equal(trace.request_offsets, [0, 5, 10])
    np.testing.assert_array_equal(trace.token_ids[:5], tok("Hello world.")["input_ids"][:5])
    assert trace.meta.extra["truncated_requests"] == 1 and trace.meta.model == "tiny-qwen3"
    assert trace.meta.extra["architecture"] == "qwen3_moe" and trace.meta.num_experts == 8


def test_collect_errors():
    model = tiny_model("mixtral")
    with pytest.raises(UserError, match="no tokenizer"):
        tokenize(["text"])
    with pytest.raises(UserError, match="every request is empty"):
        collect_trace(model, [[], []])
    with pytest.raises(UserError, match="unknown collection mode"):
        collect_trace(model, PROMPTS, mode="train")
    with pytest.raises(UserError, match=">= 0"):
        collect_trace(model, PROMPTS, pregate=-1)


def test_read_text_requests(tmp_path):
    (tmp_path / "b.txt").write_text("First para\nline two.\n\n  \n\nSecond para.\r\n\r\nThird.", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("Only one.\n", encoding="utf-8")
    (tmp_path / "skip.md").write_text("not read", encoding="utf-8")
    texts, labels = read_text_requests(tmp_path)
    assert labels == ["b.txt#0", "b.txt#1", "b.txt#2", "sub/a.txt#0"]
    assert texts[0] == "First para\nline two." and texts[1] == "Second para."
    texts, labels = read_text_requests(tmp_path, "file")
    assert labels == ["b.txt", "sub/a.txt"] and texts[1] == "Only one."
    assert read_text_requests(tmp_path / "b.txt")[1] == ["b.txt#0", "b.txt#1", "b.txt#2"]
    with pytest.raises(UserError, match="no such text file"):
        read_text_requests(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no \\*.txt files"):
        read_text_requests(tmp_path / "empty")
    with pytest.raises(UserError, match="unknown request split"):
        read_text_requests(tmp_path / "sub" / "a.txt", "sentence")  # an unknown split


@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "qwen3_moe"])
def test_router_logits_are_what_the_router_picked_from(arch):
    """Routers that pick the top-k of softmax(logits): the recorded logits rank the routed experts first
    and give their gate weights (renormalised over the k for Mixtral and Qwen3, raw for OLMoE)."""
    trace = collect_trace(tiny_model(arch), PROMPTS, router_logits=True)
    z = trace.router_logits
    assert z.shape == (trace.num_tokens, trace.num_layers, trace.num_experts) and z.dtype == np.float32
    K = trace.top_k
    top = np.sort(np.argsort(-z, axis=-1, kind="stable")[..., :K], -1)
    np.testing.assert_array_equal(top, np.sort(trace.expert_ids, -1))
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.take_along_axis(p, trace.expert_ids.astype(np.int64), -1)
    scale = trace.gate_weights / chosen
    np.testing.assert_allclose(scale, scale[..., :1].repeat(K, -1), rtol=1e-4)

"""Batched decode on an offloaded model: B sequences of different prompt lengths through
`model.generate` (left padding, attention mask) give each sequence its batch-1 full-load tokens.

The offloaded batch is compared with the full model's batch on the same inputs (the same
arithmetic: bit-identical on the CPU), and that with each prompt decoded alone; where batching's
arithmetic (padded attention) flips a near-tie, the assertion names the logit gap.
Run: pytest tests/runtime/test_batched.py -q
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqmoe.base.errors import UserError
from seqmoe.runtime import offload
from tests.arch.collect.tiny_models import ARCHS
from tests.runtime.conftest import TEST_HW, fresh, reference
from tests.runtime.test_host_path import HOST_HW

PROMPTS = [[1, 17, 42, 5, 88, 23], [1, 9, 3], [1, 61, 9, 33, 70, 12, 4, 8, 2], [1, 50]]
NEW_TOKENS = 8


def _padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate_batch(model, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> torch.Tensor:
    """[B, new_tokens] greedy continuations of left-padded `prompts`, decoded together."""
    ids, mask = _padded(prompts)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         num_beams=1, pad_token_id=0)
    return out[:, ids.shape[1]:]


def check_alone(model, batch: torch.Tensor, prompts=PROMPTS) -> None:
    """Each row of `batch` (the full model's) equals its prompt decoded alone, or the step where they
    part was a near-tie of the alone run (top-two logit gap under 1e-4), which the message names."""
    for p, row in zip(prompts, batch):
        ids = torch.tensor([p])
        alone = model.generate(ids, max_new_tokens=len(row), do_sample=False, num_beams=1, pad_token_id=0)[0, len(p):]
        n = len(alone)  # shorter when it stopped at EOS: the batch pads that row from there
        if torch.equal(alone, row[:n]) and not row[n:].any():
            continue
        k = int((alone != row[:n]).nonzero()[0])
        with torch.no_grad():
            last = model(torch.cat([ids[0], alone[:k]])[None]).logits[0, -1]
        top = last.topk(2).values
        gap = float(top[0] - top[1])
        assert gap < 1e-4, f"prompt {p}: token {k} is {int(row[k])} batched, {int(alone[k])} alone (gap {gap:.2e})"


@pytest.mark.parametrize("miss", ["copy", "auto"])
@pytest.mark.parametrize("arch", ARCHS)
def test_each_sequence_of_a_batch_gets_its_full_load_tokens(arch, miss):
    ref = reference(arch)
    full = generate_batch(ref.model)
    check_alone(ref.model, full)
    for system in ("on-demand-lru", "seqmoe"):
        model = fresh(arch)
        rt = offload(model, 0.3, system, train=ref.train, hardware=TEST_HW, miss=miss)
        got = generate_batch(model)
        assert torch.equal(got, full), f"{arch} {system} {miss}: {got.tolist()} != {full.tolist()}"
        s = rt.stats()
        width = max(map(len, PROMPTS))
        positions = len(PROMPTS) * (width + NEW_TOKENS - 1)  # every row's prompt (padding included) and decode steps
        assert s["activations"] == s["ready"] + s["late"] + s["misses"] == positions * s["num_layers"] * s["top_k"]
        assert s["copies"] > 0 and s["misses"] > 0  # the slots were used, and the host rows read
        rt.restore()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_posted_engine_decodes_a_batch(arch):
    """control='thread': the decode steps post their B x K routing, the control thread reads it."""
    ref = reference(arch)
    full = generate_batch(ref.model)
    model = fresh(arch)
    rt = offload(model, 0.3, "seqmoe", train=ref.train, hardware=TEST_HW, control="thread")
    got = generate_batch(model)
    assert torch.equal(got, full), f"{arch}: {got.tolist()} != {full.tolist()}"
    s = rt.stats()
    width = max(map(len, PROMPTS))
    assert s["activations"] == len(PROMPTS) * (width + NEW_TOKENS - 1) * s["num_layers"] * s["top_k"]
    assert sum(m.experts.posted_calls for m in rt._layers) == (NEW_TOKENS - 1) * s["num_layers"]
    rt.restore()


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_decode_graph_decodes_a_batch(arch):
    """DecodeGraph's B-row step (static cache, fixed padding mask, per-row positions) on the posted
    engine: each row's tokens are its full-load batch's; then batch 1 again, on its own state."""
    from seqmoe.runtime import DecodeGraph

    ref = reference(arch)
    full = generate_batch(ref.model)
    ids, mask = _padded(PROMPTS)
    width = ids.shape[1]
    assert torch.equal(DecodeGraph(ref.model, 32).generate(ids, NEW_TOKENS, attention_mask=mask)[:, width:], full)
    model = fresh(arch)
    rt = offload(model, 0.3, "seqmoe", train=ref.train, hardware=TEST_HW, control="thread")
    dg = DecodeGraph(rt, 32)
    got = dg.generate(ids, NEW_TOKENS, attention_mask=mask)[:, width:]
    assert torch.equal(got, full), f"{arch}: {got.tolist()} != {full.tolist()}"
    one = torch.tensor([PROMPTS[1]])
    want = ref.model.generate(one, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert torch.equal(dg.generate(one, NEW_TOKENS), want)
    s = rt.stats()
    assert s["tokens"] == len(PROMPTS) * (width + NEW_TOKENS - 1) + len(PROMPTS[1]) + NEW_TOKENS - 1
    with pytest.raises(UserError, match="1 <= B <= 16"):
        dg.generate(torch.ones((17, 2), dtype=torch.long), 2)
    rt.restore()


def test_seqmoe_tiny_batched_on_the_online_default():
    from seqmoe.arch.collect import load_model

    model, _ = load_model("seqmoe-tiny", device="cpu", dtype="float32")
    prompts = [[1, 300, 301, 302, 50], [1, 7], [1, 90, 2, 11, 400, 12, 3, 44]]
    full = generate_batch(model, prompts)
    check_alone(model, full, prompts)
    for miss in ("copy", "auto"):
        rt = offload(model, 0.3, miss=miss)
        assert torch.equal(generate_batch(model, prompts), full), miss
        assert rt.stats()["forecaster"]["source"] in ("new", "cache")
        rt.restore()


@pytest.mark.parametrize("control", ["inline", "thread"])
def test_a_batch_routes_cache_aware_each_row_within_its_tokens_budget(control):
    """Cache-aware routing in a batch: each row of a step spends its own token's KL budget; with no
    budget the routing is exact."""
    ref = reference("mixtral")
    full = generate_batch(ref.model)
    model = fresh("mixtral")
    runs = {}
    for max_kl in (0.0, 0.5):
        rt = offload(model, 0.3, "on-demand-lru", train=ref.train, hardware=TEST_HW, routing="cache-aware",
                     max_kl=max_kl, control=control)
        try:
            runs[max_kl] = (generate_batch(model), rt.stats())
        finally:
            rt.restore()
    assert torch.equal(runs[0.0][0], full) and runs[0.0][1]["mean_kl"] == 0
    s = runs[0.5][1]
    assert s["substitutions"] > 0 and 0 < s["mean_kl"] <= 0.5


@pytest.mark.parametrize("miss", ["cpu", "auto"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_a_posted_batch_computes_misses_on_the_host_cpu(arch, miss):
    """The host relay carries a step's B rows (generate, and DecodeGraph's static-cache step): each host
    expert runs once on the rows routed to it."""
    from seqmoe.runtime import DecodeGraph

    ref = reference(arch)
    full = generate_batch(ref.model)
    model = fresh(arch)
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, hardware=HOST_HW, control="thread", miss=miss)
    ids, mask = _padded(PROMPTS)
    try:
        got = generate_batch(model)
        stepped = DecodeGraph(rt, 32).generate(ids, NEW_TOKENS, attention_mask=mask)[:, ids.shape[1]:]
        relay = rt.controller.relay
        relayed, fell = relay.experts, relay.fallbacks
    finally:
        rt.restore()
    assert torch.equal(got, full), f"{arch} {miss}: {got.tolist()} != {full.tolist()}"
    assert torch.equal(stepped, full), f"{arch} {miss} DecodeGraph: {stepped.tolist()} != {full.tolist()}"
    assert relayed > 0 and fell == 0


@given(st.integers(2, 6), st.integers(1, 4), st.integers(0, 10**6))
@settings(max_examples=40, deadline=None)
def test_a_posted_step_gathers_each_expert_of_its_rows_once(b, k, seed):
    from seqmoe.runtime.core.experts import first_positions

    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(b)])
    flat = index.reshape(-1)
    at = torch.arange(b * k)
    rows = first_positions(flat, at)
    again = rows != at
    assert torch.equal(flat[rows], flat)  # each position reads a row of its own expert
    firsts = [p for p in range(b * k) if int(flat[p]) not in flat[:p].tolist()]
    assert (~again).nonzero().reshape(-1).tolist() == firsts  # gathered: each expert's first position only
    assert set(rows.tolist()) == set(firsts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_batched_step_generates_like_the_full_model_on_cuda():
    """DecodeGraph's B-row step captured as a CUDA graph on the posted engine: each row's tokens are
    the full model's batch (batched_mm: grouped_mm in fp32 cannot be captured)."""
    import copy

    from seqmoe.runtime import DecodeGraph

    ref = reference("olmoe")
    full = copy.deepcopy(ref.model).to("cuda")
    full.config._experts_implementation = "batched_mm"
    ids, mask = (t.to("cuda") for t in _padded(PROMPTS))
    want = full.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0)[:, ids.shape[1]:]
    model = fresh("olmoe")
    model.config._experts_implementation = "batched_mm"
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, device="cuda")
    dg = DecodeGraph(rt, 32)
    got = dg.generate(ids, NEW_TOKENS, attention_mask=mask)[:, ids.shape[1]:]
    assert dg.graph is not None and torch.equal(got, want)
    rt.restore()

"""Quantized experts (`offload(..., expert_dtype=...)`): the offloaded model computes what the full
model computes with the same quantized weights (`quantize_experts`), the store is smaller by what
the format says, a byte budget sets the slots, and restore and a failed offload keep their promises.

Run: pytest tests/runtime/test_quantized.py -q
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from seqmoe.arch import model_arch
from seqmoe.arch.quant import quantize_experts
from seqmoe.base.errors import UserError
from seqmoe.runtime import offload
from tests.runtime.conftest import fresh, greedy, logits, reference

ARCHS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")


def _quantized_reference(arch: str, precision: str):
    model = quantize_experts(fresh(arch), precision)
    return greedy(model), logits(model)


@pytest.mark.parametrize("miss", ["copy", "auto"])
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_quantized_model_equals_the_quantized_full_model(arch, precision, miss):
    want_tokens, want_logits = _quantized_reference(arch, precision)
    model = fresh(arch)
    rt = offload(model, 0.3, "on-demand-lru", expert_dtype=precision, miss=miss)
    assert torch.equal(greedy(model), want_tokens)
    assert (logits(model) - want_logits).abs().max().item() <= 1e-4
    s = rt.stats()
    assert s["expert_dtype"] == precision and s["misses"] > 0
    rt.restore()


@pytest.mark.parametrize("precision", ["int4", "fp8"])
def test_the_posted_engine_reads_quantized_rows_exactly(precision):
    """control="thread": each decode step gathers its K quantized rows (slot or host row) and dequantizes them."""
    want_tokens, want_logits = _quantized_reference("olmoe", precision)
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", expert_dtype=precision, control="thread", miss="copy")
    assert torch.equal(greedy(model), want_tokens)
    assert sum(m.experts.posted_calls for m in rt._layers) > 0
    rt.restore()
    assert (logits(model) - want_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch, precision, control", [
    ("qwen3_moe", "fp8-block", "inline"), ("deepseek_v3", "fp8-block", "thread"), ("mixtral", "mxfp4", "inline"),
    ("gpt_oss", "mxfp4", "thread"), ("mixtral", "q8_0", "thread"), ("gpt_oss", "q5_0", "inline"),
    ("mixtral", "q8_0/mxfp4/q5_0", "thread")])  # one format per matrix (gate, up, down), as GGUF files mix them
def test_a_model_encoded_into_a_shipped_format_equals_the_same_full_model(arch, precision, control):
    """expert_dtype a shipped format: the experts encoded by round to nearest into the file's layout
    (`ShippedLayout`), computed as `quantize_experts` with the same format computes; restore gives those."""
    want_tokens, want_logits = _quantized_reference(arch, precision)
    model = fresh(arch)
    rt = offload(model, 0.3, "on-demand-lru", expert_dtype=precision, control=control, miss="auto")
    assert torch.equal(greedy(model), want_tokens)
    assert rt.stats()["expert_dtype"] == precision and rt.stats()["misses"] > 0
    rt.restore()
    assert (logits(model) - want_logits).abs().max().item() <= 1e-4


def test_the_store_and_the_slots_carry_the_quantized_bytes():
    model = fresh("mixtral")
    experts = model_arch(model).moe[0].experts
    bf16_bytes = 2 * model_arch(model).layout(experts).numel  # the same expert stored in bf16
    budget = 5 * bf16_bytes  # 5 bf16 experts; the 24 of the model cap what a smaller store fits
    sizes, slots = {}, {}
    for precision in (None, "int8", "int4"):
        m = fresh("mixtral")
        rt = offload(m, expert_dtype=precision, expert_memory=budget)
        s = rt.stats()
        sizes[precision], slots[precision] = s["expert_bytes"], s["capacity"]
        assert s["device_expert_bytes"] == s["capacity"] * s["expert_bytes"] <= budget
        assert s["host_expert_bytes"] == s["num_layers"] * s["num_experts"] * s["expert_bytes"]
        assert s["residency"] == s["capacity"] / (s["num_layers"] * s["num_experts"])
        rt.restore()
    assert sizes["int4"] <= 0.3 * bf16_bytes and sizes["int8"] <= 0.55 * bf16_bytes
    bf16_slots = budget // bf16_bytes
    assert slots["int4"] >= 3.3 * bf16_slots and slots["int8"] >= 1.8 * bf16_slots


def test_a_budget_below_one_layers_experts_is_a_user_error():
    model = fresh("olmoe")
    with pytest.raises(UserError, match="fewer than the 2 one layer needs"):
        offload(model, expert_memory=1000, expert_dtype="int4")
    assert torch.equal(greedy(model), reference("olmoe").tokens)


def test_restore_gives_the_quantized_weights_and_a_failed_offload_the_original_ones(monkeypatch):
    model = fresh("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    offload_module = importlib.import_module("seqmoe.runtime.offload")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(offload_module, "install_hooks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        offload(model, 0.3, expert_dtype="int4")
    monkeypatch.undo()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # not the quantized values
    rt = offload(model, 0.3, expert_dtype="int4")
    rt.restore()
    want = dict(quantize_experts(fresh("qwen3_moe"), "int4").named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_row_holds_codes_and_float32_scales_per_group():
    """A 2-D weight of n numbers takes n x bits / 8 code bytes (whole groups of 64) and 4 bytes a group."""
    model = fresh("olmoe")
    rt = offload(model, 0.5, expert_dtype="int4")
    layout = rt.pool.hosts[0]
    base = model_arch(fresh("olmoe")).layout(model_arch(fresh("olmoe")).moe[0].experts)
    want = sum(math.ceil(math.prod(s) / 64) * (32 + 4) for s in base.shapes)
    assert layout.shape[1] == want and layout.dtype == torch.uint8
    rt.restore()


def test_decode_graph_reads_quantized_rows_like_the_quantized_full_model():
    """The posted step with a quantized store, through DecodeGraph (eager on the CPU, captured on CUDA)."""
    from seqmoe.runtime import DecodeGraph
    from tests.runtime.conftest import PROMPT

    want, _ = _quantized_reference("qwen3_moe", "int4")
    model = fresh("qwen3_moe")
    rt = offload(model, 0.3, "on-demand-lru", expert_dtype="int4", control="thread")
    assert torch.equal(DecodeGraph(rt, 32).generate(torch.tensor([PROMPT]), 8), want)
    rt.restore()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch, precision", [("qwen3_moe", "int8"), ("qwen3_moe", "int4"), ("qwen3_moe", "fp8"),
                                            ("qwen3_moe", "fp8-block"), ("mixtral", "mxfp4"), ("mixtral", "q8_0")])
def test_a_captured_cuda_step_reads_quantized_rows(arch, precision):
    """On CUDA, inside the graph: int8 and int4 rows (and the linears of FP8-block, MXFP4 and Q8_0 rows)
    are read and dequantized by one kernel per parameter (`gather_dequantized`), fp8 rows gathered and
    dequantized by torch ops; greedy tokens equal the quantized full model's on the same device."""
    from seqmoe.runtime import DecodeGraph
    from tests.runtime.conftest import PROMPT

    full = quantize_experts(fresh(arch), precision).cuda()
    full.config._experts_implementation = "batched_mm"  # grouped_mm in fp32 cannot be captured
    want = DecodeGraph(full, 32).generate(torch.tensor([PROMPT]).cuda(), 8)
    model = fresh(arch)
    model.config._experts_implementation = "batched_mm"
    rt = offload(model, 0.3, "on-demand-lru", expert_dtype=precision, device="cuda", control="thread")
    dg = DecodeGraph(rt, 32)
    got = dg.generate(torch.tensor([PROMPT]).cuda(), 8)
    assert dg.graph is not None and torch.equal(got, want)
    rt.restore()


def test_the_pool_room_is_the_free_memory_the_dense_part_and_a_margin_leave(monkeypatch):
    """What `offload` on CUDA with neither residency nor budget fits (`pool_room`), with CUDA's memory
    queries stood in for: 8 GiB free, nothing reserved, the dense part still on the CPU."""
    from seqmoe.runtime.core import device as device_module

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 << 30, 16 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    model = fresh("olmoe")
    experts = [m.experts for m in model_arch(model).moe]
    routed = {id(p) for x in experts for p in x.parameters()}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in routed)
    dense += sum(b.numel() * b.element_size() for b in model.buffers())
    room = device_module.pool_room(model, experts, torch.device("cuda", 0))
    assert room == int((8 << 30) * (1 - device_module.FIT_MARGIN) - dense)

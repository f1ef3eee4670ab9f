"""The quantized expert format (`seqmoe.arch.quant`, `seqmoe.costs.precision`): codes and scales round
trip within half a step, int4 codes pack two a byte, sizes are what the simulator prices.

Run: pytest tests/arch/test_quant.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqmoe.arch import model_arch
from seqmoe.arch.quant import QuantLayout, _pack_nibbles, _unpack_nibbles, dequantize, quantize, quantize_experts
from seqmoe.base.errors import UserError
from seqmoe.costs.precision import GROUP, QMAX, format_bytes, parse_bytes, quantized_bytes
from seqmoe.costs.profiles import get_model_profile
from tests.arch.collect.tiny_models import tiny_model


@pytest.mark.parametrize("precision", ["int8", "int4", "fp8"])
def test_a_round_trip_stays_within_half_a_step_of_each_group(precision):
    torch.manual_seed(0)
    w = torch.randn(3, 1000) * torch.logspace(-3, 1, 1000)  # groups of very different scales
    w[1, :GROUP] = 0  # an all-zero group
    codes, scales = quantize(w, precision)
    back = dequantize(codes, scales, precision, 1000)
    assert codes.dtype == torch.uint8 and codes.shape[1] + scales.shape[1] * 4 == quantized_bytes(1000, precision)
    assert torch.equal(back[1, :GROUP], torch.zeros(GROUP))
    step = torch.repeat_interleave(scales, GROUP, dim=1)[:, :1000]
    if precision == "fp8":  # e4m3: 3 mantissa bits, a relative error of at most 2^-4 of the scaled value
        assert ((back - w).abs() <= (w.abs() / 16 + step / 512)).all()
    else:
        assert ((back - w).abs() <= step / 2 + 1e-6).all()
    absmax = torch.nn.functional.pad(w, (0, scales.shape[1] * GROUP - 1000)).view(3, -1, GROUP).abs().amax(-1)
    assert torch.equal(scales, torch.where(absmax > 0, absmax / QMAX[precision], torch.ones_like(absmax)))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-7, 7), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_int4_codes_pack_two_a_byte_and_unpack_back(values):
    q = torch.tensor([values], dtype=torch.int8)
    packed = _pack_nibbles(q)
    assert packed.shape == (1, len(values) // 2) and torch.equal(_unpack_nibbles(packed), q)


def test_quantize_experts_writes_what_the_rows_dequantize_to():
    model = tiny_model("gpt_oss")  # biases: vectors stay at the model's dtype
    arch = model_arch(model)
    experts = arch.moe[0].experts
    layout = QuantLayout.of(arch.layout(experts), "int4")
    rows = torch.empty((experts.num_experts, layout.numel), dtype=torch.uint8)
    layout.pack(experts, rows)
    biases = {n: getattr(experts, n).detach().clone() for n, s in zip(layout.names, layout.shapes) if len(s) == 1}
    quantize_experts(model, "int4")
    for name, value in layout.views(rows).items():
        assert torch.equal(getattr(experts, name), value), name
    assert biases and all(torch.equal(getattr(experts, n), b) for n, b in biases.items())


def test_sizes_ratios_and_budgets():
    ds = get_model_profile("deepseek-v2-lite")
    for precision, at_most in (("int4", 0.3), ("int8", 0.55), ("fp8", 0.55)):
        assert ds.at_precision(precision).expert_bytes <= at_most * ds.expert_bytes
    assert ds.at_precision(None) is ds
    assert quantized_bytes(64, "int4") == 32 + 4 and quantized_bytes(65, "int8") == 128 + 8
    assert parse_bytes("12GiB") == 12 << 30 and parse_bytes("1.5MiB") == 3 << 19 and parse_bytes(4096) == 4096
    assert format_bytes(3 << 19) == "1.50 MiB"
    for bad in ("12GB", "-1", "0", "lots"):
        with pytest.raises(UserError):
            parse_bytes(bad)
    assert math.isclose(quantized_bytes(3 * 2048 * 1408, "int4") / ds.expert_bytes, 0.28125)

"""The simulator at shipped precision: `--expert-dtype fp8-block|mxfp4|gptq-int4|q8_0|q5_0|q4_k` prices an
expert at the bytes its file stores (codes, scales, zero points), matrix by matrix from the profile's
`expert_shapes`; the shipped models are presets.
Run: pytest tests/test_shipped_prices.py -q
"""

from __future__ import annotations

import pytest

from seqmoe.base.errors import UserError
from seqmoe.config import SimConfig
from seqmoe.costs.precision import matrix_bytes
from seqmoe.costs.profiles import MODEL_PROFILES, ModelProfile
from seqmoe.sim.run import load_workload, run_one
from tests.conftest import make_trace


def test_matrix_bytes_follow_each_files_tensors():
    # Qwen3-30B-A3B's gate [768, 2048]: fp8 codes + a float32 scale per 128 x 128 block
    assert matrix_bytes(768, 2048, "fp8-block") == 768 * 2048 + 6 * 16 * 4
    assert matrix_bytes(100, 200, "fp8-block") == 100 * 200 + 1 * 2 * 4  # edge blocks count whole
    # gpt-oss's fused gate_up [5760, 2880]: 16 bytes of codes + 1 exponent byte per 32 inputs
    assert matrix_bytes(5760, 2880, "mxfp4") == 5760 * 90 * 17
    # GPTQ [768, 2048]: qweight int32 [256, 768], qzeros int32 [16, 96], scales f16 [16, 768], g_idx int32 [2048]
    assert matrix_bytes(768, 2048, "gptq-int4") == 256 * 768 * 4 + 16 * 96 * 4 + 16 * 768 * 2 + 2048 * 4
    assert matrix_bytes(1408, 2048, "q4_k") == 1408 * 8 * 144
    assert matrix_bytes(2048, 1408, "q5_0") == 2048 * 44 * 22
    assert matrix_bytes(2048, 1408, "q8_0") == 2048 * 44 * 34
    with pytest.raises(UserError, match=r"q4_k stores a matrix's inputs in whole blocks of 256: a \[2048, 1408\]"):
        matrix_bytes(2048, 1408, "q4_k")


def test_shipped_presets_are_their_base_models_at_the_shipped_format():
    base, fp8 = MODEL_PROFILES["qwen3-30b-a3b"], MODEL_PROFILES["qwen3-30b-a3b-fp8"]
    assert base.at_precision("fp8-block").expert_bytes == fp8.expert_bytes == 3 * 768 * 2048 + 3 * 6 * 16 * 4
    assert MODEL_PROFILES["gpt-oss-120b"].expert_bytes == MODEL_PROFILES["gpt-oss-20b"].expert_bytes
    assert MODEL_PROFILES["gpt-oss-20b"].at_precision("mxfp4").expert_bytes + 3 * 2880 * 2 == \
        MODEL_PROFILES["gpt-oss-20b"].expert_bytes  # the bf16 biases are the rest
    q4 = MODEL_PROFILES["deepseek-v2-lite-q4_k"]
    assert q4.expert_bytes == 2 * matrix_bytes(1408, 2048, "q4_k") + matrix_bytes(2048, 1408, "q5_0")
    with pytest.raises(UserError, match="whole blocks of 256"):  # the down matrix: llama.cpp falls back too
        MODEL_PROFILES["deepseek-v2-lite"].at_precision("q4_k")
    assert MODEL_PROFILES["deepseek-v2-lite"].at_precision("q4_k/q4_k/q5_0").expert_bytes == q4.expert_bytes
    with pytest.raises(UserError, match="names 2 formats, but an expert has 3 weight matrices"):
        MODEL_PROFILES["deepseek-v2-lite"].at_precision("q4_k/q5_0")
    with pytest.raises(UserError, match="unknown expert precision 'q4_k/q3_k'"):
        MODEL_PROFILES["deepseek-v2-lite"].at_precision("q4_k/q3_k")
    # the runtime formats price alike with or without shapes (every matrix a whole number of groups)
    for p in ("int8", "int4", "fp8"):
        shapeless = ModelProfile(**{**base.to_dict(), "expert_shapes": ()})
        assert shapeless.at_precision(p).expert_bytes == base.at_precision(p).expert_bytes


def test_shapes_are_needed_for_a_shipped_format_and_checked():
    shapeless = ModelProfile(**{**MODEL_PROFILES["qwen3-30b-a3b"].to_dict(), "expert_shapes": ()})
    with pytest.raises(UserError, match="gives no expert_shapes, which mxfp4 is priced by"):
        shapeless.at_precision("mxfp4")
    with pytest.raises(UserError, match=r"expert_shapes must be \[outputs, inputs\] pairs"):
        ModelProfile(**{**shapeless.to_dict(), "expert_shapes": [[768, 0]]})
    with pytest.raises(UserError, match="unknown expert precision 'nf4'"):
        shapeless.at_precision("nf4")


def test_a_replay_copies_the_shipped_bytes():
    trace = make_trace(num_tokens=60, num_layers=48, num_experts=128, top_k=8, num_requests=2)
    rows = {}
    for dtype in (None, "fp8-block", "gptq-int4"):
        cfg = SimConfig(trace="unused", model_profile="qwen3-30b-a3b", system="on-demand-lru", residency=0.1,
                        expert_dtype=dtype)
        rows[dtype] = run_one(load_workload(cfg, train=trace, test=trace), cfg)
    per_expert = {d: MODEL_PROFILES["qwen3-30b-a3b"].at_precision(d).expert_bytes for d in rows}
    for d, row in rows.items():
        assert row["copies"] == rows[None]["copies"] > 0  # the same decisions: LRU does not look at bytes
        assert row["bytes_copied"] == row["copies"] * per_expert[d]
    assert per_expert["fp8-block"] == MODEL_PROFILES["qwen3-30b-a3b-fp8"].expert_bytes

"""Model and hardware profiles: presets against docs/DESIGN.md's numbers, file loading, validation.

Run: .venv/bin/pytest tests/test_profiles.py -q
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from seqmoe.base.errors import UserError
from seqmoe.costs.host_cost import host_expert_time_s
from seqmoe.costs.presets import swiglu_bytes
from seqmoe.costs.profiles import (
    HARDWARE_PROFILES,
    MODEL_PROFILES,
    HardwareProfile,
    ModelProfile,
    copy_time_s,
    full_load_token_s,
    get_hardware_profile,
    get_model_profile,
    layer_times_s,
    token_overhead_s,
)

# docs/DESIGN.md, "Hardware and model facts for profiles": (MB per expert, copy ms at 25 / 50 GB/s).
DESIGN_EXPERTS = {
    "mixtral-8x7b": (352, 14.1, 7.0),
    "deepseek-v2-lite": (17.3, 0.69, 0.35),
    "qwen3-30b-a3b": (9.44, 0.38, 0.19),
    "olmoe-1b-7b": (12.6, 0.50, 0.25),
}
# docs/DESIGN.md: decode time per layer at batch 1, seconds.
DESIGN_LAYER_S = {
    ("mixtral-8x7b", "h100-pcie5"): 0.34e-3,
    ("deepseek-v2-lite", "h100-pcie5"): 71e-6,
    ("qwen3-30b-a3b", "h100-pcie5"): 48e-6,
    ("mixtral-8x7b", "rtx4090-pcie4"): 1.12e-3,
    ("deepseek-v2-lite", "rtx4090-pcie4"): 235e-6,
    ("qwen3-30b-a3b", "rtx4090-pcie4"): 160e-6,
}
REQUIRED_MODELS = {"mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b", "olmoe-1b-7b", "gpt-oss-20b", "deepseek-v3"}
REQUIRED_HARDWARE = {"rtx4090-pcie4", "a100-pcie4", "h100-pcie5", "h200-pcie5"}


def _layer_s(model: ModelProfile, hw: HardwareProfile) -> float:
    non_expert, per_expert = layer_times_s(model, hw)
    return non_expert + model.top_k * per_expert


def test_presets_exist_and_round_trip():
    assert REQUIRED_MODELS <= set(MODEL_PROFILES) and REQUIRED_HARDWARE <= set(HARDWARE_PROFILES)
    for name, prof in MODEL_PROFILES.items():
        assert prof.name == name and prof.source
        assert ModelProfile(**json.loads(json.dumps(prof.to_dict()))) == prof
    for name, prof in HARDWARE_PROFILES.items():
        assert prof.name == name and prof.source
        assert HardwareProfile(**json.loads(json.dumps(prof.to_dict()))) == prof


@pytest.mark.parametrize("name", sorted(DESIGN_EXPERTS))
def test_expert_bytes_and_copy_times_match_design(name):
    mb, copy25_ms, copy50_ms = DESIGN_EXPERTS[name]
    m = MODEL_PROFILES[name]
    assert m.expert_bytes / 1e6 == pytest.approx(mb, rel=0.03)
    # docs/DESIGN.md's copy times are bytes / bandwidth, without the per-copy overhead alpha.
    assert m.expert_bytes / 25e9 * 1e3 == pytest.approx(copy25_ms, rel=0.03)
    assert m.expert_bytes / 50e9 * 1e3 == pytest.approx(copy50_ms, rel=0.03)
    for hw in HARDWARE_PROFILES.values():
        assert copy_time_s(m, hw) == pytest.approx(hw.copy_overhead_s + m.expert_bytes / hw.h2d_bytes_per_s)


@pytest.mark.parametrize(("model", "hw"), sorted(DESIGN_LAYER_S))
def test_layer_times_match_design(model, hw):
    assert _layer_s(MODEL_PROFILES[model], HARDWARE_PROFILES[hw]) == pytest.approx(DESIGN_LAYER_S[model, hw], rel=0.03)


def test_cost_model_formulas():
    m, hw = MODEL_PROFILES["deepseek-v2-lite"], HARDWARE_PROFILES["h100-pcie5"]
    rate = hw.hbm_efficiency * hw.hbm_bytes_per_s
    assert layer_times_s(m, hw) == pytest.approx((m.layer_bytes / rate, m.expert_bytes / rate))
    assert token_overhead_s(m, hw) == pytest.approx(m.token_bytes / rate)
    assert full_load_token_s(m, hw) == pytest.approx(token_overhead_s(m, hw) + m.num_layers * _layer_s(m, hw))
    assert swiglu_bytes(2048, 1408, 2) == 3 * 2048 * 1408 * 2


def test_other_presets_are_plausible():
    # gpt-oss-20b experts are MXFP4 (4.25 bits/param): 3 x 2880^2 params -> about 13.2 MB.
    assert MODEL_PROFILES["gpt-oss-20b"].expert_bytes / 1e6 == pytest.approx(13.24, rel=0.01)
    # DeepSeek-V3 experts are FP8: 3 x 7168 x 2048 bytes = 44 MB and a float32 scale per 128 x 128 block
    # (3 x 56 x 16); 58 MoE layers of 256, top-8.
    v3 = MODEL_PROFILES["deepseek-v3"]
    assert (v3.num_layers, v3.num_experts, v3.top_k, v3.expert_bytes) == (58, 256, 8, 3 * 7168 * 2048 + 3 * 56 * 16 * 4)
    h100 = HARDWARE_PROFILES["h100-pcie5"]
    for m in MODEL_PROFILES.values():  # batch-1 decode layers take tens to hundreds of microseconds
        if m.name != "seqmoe-tiny":  # ours is 12 M parameters: a layer reads 0.5 MB
            assert m.layer_bytes > 0 and m.token_bytes > 0 and 20e-6 < _layer_s(m, h100) < 0.5e-3


def test_seqmoe_tiny_preset_matches_the_shipped_config():
    from seqmoe.arch.tiny import MODEL_DIR

    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip("seqmoe-tiny is not in this install")
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    tiny = MODEL_PROFILES["seqmoe-tiny"]
    assert (tiny.num_layers, tiny.num_experts, tiny.top_k) == (cfg["num_hidden_layers"], cfg["num_experts"],
                                                                cfg["num_experts_per_tok"])
    assert tiny.expert_bytes == 3 * cfg["hidden_size"] * cfg["intermediate_size"] * 2


def test_custom_json_and_toml(tmp_path):
    fields = MODEL_PROFILES["olmoe-1b-7b"].to_dict() | {"name": "mine", "expert_bytes": 1.5e6}  # whole float ok
    (tmp_path / "m.json").write_text(json.dumps(fields))
    assert get_model_profile(tmp_path / "m.json").expert_bytes == 1_500_000
    toml = "h2d_bytes_per_s = 3e10\nhbm_bytes_per_s = 2e12\ndevice_memory_bytes = 1_000_000\n"
    (tmp_path / "hw.toml").write_text(toml)
    hw = get_hardware_profile(str(tmp_path / "hw.toml"))
    assert (hw.name, hw.h2d_bytes_per_s, hw.hbm_efficiency, hw.copy_overhead_s) == ("hw", 3e10, 0.7, 20e-6)
    assert host_expert_time_s(MODEL_PROFILES["olmoe-1b-7b"], hw) is None  # no host fields: no CPU path
    (tmp_path / "host.toml").write_text(toml + "host_cores = 16.0\nhost_memory_bytes_per_s = 8.32e10\n")
    assert get_hardware_profile(tmp_path / "host.toml").host_cores == 16


def test_host_expert_time_scales_the_measurement_by_cited_bandwidth_and_cores():
    ds = MODEL_PROFILES["deepseek-v2-lite"]
    desktop, server = HARDWARE_PROFILES["rtx4090-pcie4"], HARDWARE_PROFILES["h100-pcie5"]
    assert desktop.host_cores == 16 and desktop.host_memory_bytes_per_s == pytest.approx(83.2e9)
    # Memory-bound on both: 0.82 x 0.75 of 83.2 / 460.8 GB/s, plus one transfer's overhead.
    assert host_expert_time_s(ds, desktop) == pytest.approx(20e-6 + ds.expert_bytes / (0.615 * 83.2e9))
    assert host_expert_time_s(ds, server) == pytest.approx(20e-6 + ds.expert_bytes / (0.615 * 460.8e9))
    few_cores = dataclasses.replace(server, host_cores=2)  # core-bound: 2 x 13 GB/s
    assert host_expert_time_s(ds, few_cores) == pytest.approx(20e-6 + ds.expert_bytes / 26e9)


@pytest.mark.parametrize(("text", "match"), [
    ('{"h2d_bytes_per_s": 1e10, "hbm_bytes_per_s": 1e12, "device_memory_bytes": 1, "pcie": 4}', "unknown field.*pcie"),
    ('{"h2d_bytes_per_s": 1e10, "device_memory_bytes": 1}', "missing required.*hbm_bytes_per_s"),
    ('{"h2d_bytes_per_s": -1e10, "hbm_bytes_per_s": 1e12, "device_memory_bytes": 1}', "h2d_bytes_per_s must be > 0"),
    ('{"h2d_bytes_per_s": 1e10, "hbm_bytes_per_s": 1e12, "device_memory_bytes": 1, "hbm_efficiency": 1.5}',
     "hbm_efficiency"),
    ('{"h2d_bytes_per_s": "fast", "hbm_bytes_per_s": 1e12, "device_memory_bytes": 1}', "finite number"),
    ("[1, 2]", "table/object"),
    ("{not json", "cannot read"),
    ('{"h2d_bytes_per_s": 1e10, "hbm_bytes_per_s": 1e12, "device_memory_bytes": 1, "host_cores": 8}', "together"),
    ('{"h2d_bytes_per_s": 1e10, "hbm_bytes_per_s": 1e12, "device_memory_bytes": 1, "host_cores": 0, '
     '"host_memory_bytes_per_s": 1e11}', "host_cores must be >= 1"),
])
def test_bad_hardware_files(tmp_path, text, match):
    (tmp_path / "hw.json").write_text(text)
    with pytest.raises(UserError, match=match):
        get_hardware_profile(tmp_path / "hw.json")


def test_unknown_names_and_bad_models(tmp_path):
    with pytest.raises(UserError, match=r"unknown model profile 'x'; choose one of: mixtral-8x7b, .*, or give a"):
        get_model_profile("x")
    with pytest.raises(UserError, match=r"unknown hardware profile 'tpu'"):
        get_hardware_profile("tpu")
    with pytest.raises(UserError, match="not found"):
        get_model_profile(tmp_path / "absent.toml")
    with pytest.raises(UserError, match="top_k=9 exceeds num_experts=8"):
        ModelProfile(num_layers=2, num_experts=8, top_k=9, expert_bytes=10)
    with pytest.raises(UserError, match="num_layers must be an integer"):
        ModelProfile(num_layers=2.5, num_experts=8, top_k=2, expert_bytes=10)
    with pytest.raises(UserError, match="expert_bytes must be >= 1"):
        ModelProfile(num_layers=2, num_experts=8, top_k=2, expert_bytes=0)

"""Model and hardware profiles for the cost model: expert sizes, bytes read per layer, link speeds.

A `ModelProfile` says how many bytes one routed expert occupies and how many other bytes a decode
token reads; a `HardwareProfile` says how fast host->device copies and HBM reads are. Together
they give the cost model of docs/DESIGN.md ("Evaluation protocol"): one copy takes
`alpha + expert_bytes / h2d`, and a batch-1 decode layer is bound by HBM bandwidth, taking
`bytes_read / (efficiency x peak)`.

Presets are computed from each model's config.json in `_model_presets()`, so the arithmetic is
visible; custom profiles load from a JSON or TOML file holding the dataclass fields::

    model = get_model_profile("deepseek-v2-lite")      # or get_model_profile("my_model.toml")
    hw = get_hardware_profile("h100-pcie5")
    copy_time_s(model, hw), layer_times_s(model, hw), full_load_token_s(model, hw)
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from seqmoe.errors import UserError
from seqmoe.precision import quantized_bytes

BF16 = 2
"""Bytes per bf16 parameter."""
FP8 = 1
"""Bytes per FP8 (e4m3) parameter."""
MXFP4 = 17 / 32
"""Bytes per MXFP4 parameter: 4-bit values plus one 8-bit scale per 32 values = 4.25 bits."""


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Sizes of one MoE model, as read by a batch-1 decode step."""

    name: str = "custom"
    """Profile name (a preset key, or free text for a custom file)."""
    num_layers: int
    """L: MoE layers (dense layers are counted in `token_bytes`)."""
    num_experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """K: routed experts each token uses per MoE layer."""
    expert_bytes: int
    """Bytes of one routed expert as stored and copied (all its matrices, scales and biases)."""
    layer_bytes: int = 0
    """Bytes read per MoE layer per decode token besides routed experts (attention, router, shared experts, norms)."""
    token_bytes: int = 0
    """Bytes read per decode token outside the MoE layers (dense layers, embedding row, lm_head)."""
    expert_params: int = 0
    """Weights of one routed expert's matrices, what a quantized store prices (0: expert_bytes / 2, a
    16-bit store)."""
    source: str = "user file"
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        what = f"model profile '{self.name}'"
        for f in ("num_layers", "num_experts", "top_k", "expert_bytes"):
            _check_number(what, f, getattr(self, f), integer=True, minimum=1)
        for f in ("layer_bytes", "token_bytes", "expert_params"):
            _check_number(what, f, getattr(self, f), integer=True, minimum=0)
        if self.top_k > self.num_experts:
            raise UserError(f"{what}: top_k={self.top_k} exceeds num_experts={self.num_experts}")

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict (the format `get_model_profile` reads)."""
        return dataclasses.asdict(self)

    def at_precision(self, precision: str | None) -> ModelProfile:
        """This model with its experts stored at `precision` (`seqmoe.precision`: the runtime's
        format, vectors such as biases left out); itself for None."""
        if precision is None:
            return self
        params = self.expert_params or self.expert_bytes // 2
        return dataclasses.replace(self, name=f"{self.name} ({precision} experts)",
                                   expert_bytes=quantized_bytes(params, precision))


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Speeds and capacity of one accelerator and its host link."""

    name: str = "custom"
    """Profile name (a preset key, or free text for a custom file)."""
    h2d_bytes_per_s: float
    """Effective pinned host->device copy bandwidth, bytes/s."""
    copy_overhead_s: float = 20e-6
    """alpha: fixed cost of one expert copy (launch, synchronisation), seconds."""
    hbm_bytes_per_s: float
    """Peak device memory (HBM/GDDR) bandwidth, bytes/s."""
    hbm_efficiency: float = 0.7
    """Fraction of peak memory bandwidth a batch-1 decode reaches, in (0, 1]."""
    device_memory_bytes: int
    """Device memory capacity, bytes."""
    host_memory_bytes_per_s: float | None = None
    """Peak host DRAM bandwidth (channels x MT/s x 8 bytes), bytes/s; None: no CPU miss path (`seqmoe.host_cost`)."""
    host_cores: int | None = None
    """Host CPU cores that compute experts (with `host_memory_bytes_per_s`)."""
    source: str = "user file"
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        what = f"hardware profile '{self.name}'"
        _check_number(what, "h2d_bytes_per_s", self.h2d_bytes_per_s, minimum=0, strict=True)
        _check_number(what, "copy_overhead_s", self.copy_overhead_s, minimum=0)
        _check_number(what, "hbm_bytes_per_s", self.hbm_bytes_per_s, minimum=0, strict=True)
        _check_number(what, "hbm_efficiency", self.hbm_efficiency, minimum=0, strict=True)
        if self.hbm_efficiency > 1:
            raise UserError(f"{what}: hbm_efficiency must be in (0, 1], got {self.hbm_efficiency}")
        _check_number(what, "device_memory_bytes", self.device_memory_bytes, integer=True, minimum=1)
        if (self.host_memory_bytes_per_s is None) != (self.host_cores is None):
            raise UserError(f"{what}: give host_memory_bytes_per_s and host_cores together (or neither: no CPU path)")
        if self.host_cores is not None:
            _check_number(what, "host_memory_bytes_per_s", self.host_memory_bytes_per_s, minimum=0, strict=True)
            _check_number(what, "host_cores", self.host_cores, integer=True, minimum=1)

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict (the format `get_hardware_profile` reads)."""
        return dataclasses.asdict(self)


def _check_number(what: str, field: str, value, *, integer: bool = False, minimum: float = 0,
                  strict: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise UserError(f"{what}: {field} must be {'an integer' if integer else 'a finite number'}, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise UserError(f"{what}: {field} must be {'>' if strict else '>='} {minimum}, got {value!r}")


# ---- cost model -------------------------------------------------------------------------------


def _hbm_rate(hw: HardwareProfile) -> float:
    return hw.hbm_efficiency * hw.hbm_bytes_per_s


def copy_time_s(model: ModelProfile, hw: HardwareProfile) -> float:
    """Seconds one expert copy occupies the copy engine: `alpha + expert_bytes / h2d`."""
    return hw.copy_overhead_s + model.expert_bytes / hw.h2d_bytes_per_s


def layer_times_s(model: ModelProfile, hw: HardwareProfile) -> tuple[float, float]:
    """Decode time of one MoE layer at batch 1, split as (non-expert seconds, seconds per routed expert)."""
    rate = _hbm_rate(hw)
    return model.layer_bytes / rate, model.expert_bytes / rate


def token_overhead_s(model: ModelProfile, hw: HardwareProfile) -> float:
    """Seconds per decode token spent outside the MoE layers (dense layers, lm_head)."""
    return model.token_bytes / _hbm_rate(hw)


def full_load_token_s(model: ModelProfile, hw: HardwareProfile) -> float:
    """Seconds per decode token with every expert resident: overhead + L x (non-expert + K x per-expert)."""
    non_expert, per_expert = layer_times_s(model, hw)
    return token_overhead_s(model, hw) + model.num_layers * (non_expert + model.top_k * per_expert)


# ---- byte counts from config.json fields --------------------------------------------------------


def _b(params: float, bytes_per_param: float) -> int:
    return int(round(params * bytes_per_param))


def swiglu_bytes(hidden: int, inter: int, bytes_per_param: float, bias_bytes_per_param: float = 0) -> int:
    """Bytes of one SwiGLU MLP (gate, up: H->I; down: I->H), plus biases when `bias_bytes_per_param` > 0."""
    return _b(3 * hidden * inter, bytes_per_param) + _b(2 * inter + hidden, bias_bytes_per_param)


def gqa_attention_bytes(hidden: int, q_heads: int, kv_heads: int, head_dim: int, bytes_per_param: float,
                        bias: bool = False, extra_params: int = 0) -> int:
    """Bytes of grouped-query attention: q, k, v and o projections (+ biases, + `extra_params` such as qk-norms)."""
    q, kv = q_heads * head_dim, kv_heads * head_dim
    params = hidden * q + 2 * hidden * kv + q * hidden + extra_params
    if bias:
        params += q + 2 * kv + hidden
    return _b(params, bytes_per_param)


def mla_attention_bytes(hidden: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int, qk_nope: int,
                        qk_rope: int, v_head: int, bytes_per_param: float, norm_bytes_per_param: float = BF16) -> int:
    """Bytes of DeepSeek multi-head latent attention (q path with or without a LoRA, kv_a, kv_b, o, latent norms)."""
    q_out = heads * (qk_nope + qk_rope)
    q = hidden * q_out if q_lora_rank is None else hidden * q_lora_rank + q_lora_rank * q_out
    kv_a = hidden * (kv_lora_rank + qk_rope)
    kv_b = kv_lora_rank * heads * (qk_nope + v_head)
    o = heads * v_head * hidden
    norms = kv_lora_rank + (q_lora_rank or 0)
    return _b(q + kv_a + kv_b + o, bytes_per_param) + _b(norms, norm_bytes_per_param)


def router_bytes(hidden: int, num_experts: int, bytes_per_param: float = BF16, bias: bool = False) -> int:
    """Bytes of a linear router H->E (+ bias)."""
    return _b(hidden * num_experts + (num_experts if bias else 0), bytes_per_param)


def norms_bytes(hidden: int, count: int = 2, bytes_per_param: float = BF16) -> int:
    """Bytes of `count` RMSNorm weight vectors of size H (two per decoder layer)."""
    return _b(count * hidden, bytes_per_param)


def output_bytes(vocab: int, hidden: int, bytes_per_param: float = BF16) -> int:
    """Bytes read per token around the layers: one embedding row, the final norm and an untied lm_head."""
    return _b(hidden + hidden + vocab * hidden, bytes_per_param)


# ---- presets ------------------------------------------------------------------------------------


def _model_presets() -> dict[str, ModelProfile]:
    presets = []

    # mistralai/Mixtral-8x7B-v0.1 config.json: num_hidden_layers=32, num_local_experts=8,
    # num_experts_per_tok=2, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
    # num_key_value_heads=8 (head_dim 4096/32=128), vocab_size=32000, tie_word_embeddings=false,
    # torch_dtype=bfloat16. Every layer is MoE.
    presets.append(ModelProfile(
        name="mixtral-8x7b", num_layers=32, num_experts=8, top_k=2,
        expert_bytes=swiglu_bytes(4096, 14336, BF16),
        expert_params=3 * 4096 * 14336,
        layer_bytes=gqa_attention_bytes(4096, 32, 8, 128, BF16) + router_bytes(4096, 8) + norms_bytes(4096),
        token_bytes=output_bytes(32000, 4096),
        source="config.json of mistralai/Mixtral-8x7B-v0.1 (bf16)"))

    # deepseek-ai/DeepSeek-V2-Lite config.json: num_hidden_layers=27, first_k_dense_replace=1
    # (layer 0 dense, intermediate_size=10944), n_routed_experts=64, num_experts_per_tok=6,
    # n_shared_experts=2, moe_intermediate_size=1408, hidden_size=2048, num_attention_heads=16,
    # q_lora_rank=null, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    # v_head_dim=128, vocab_size=102400, tie_word_embeddings=false, torch_dtype=bfloat16.
    dsv2l_attn = mla_attention_bytes(2048, 16, None, 512, 128, 64, 128, BF16)
    presets.append(ModelProfile(
        name="deepseek-v2-lite", num_layers=26, num_experts=64, top_k=6,
        expert_bytes=swiglu_bytes(2048, 1408, BF16),
        expert_params=3 * 2048 * 1408,
        layer_bytes=dsv2l_attn + 2 * swiglu_bytes(2048, 1408, BF16) + router_bytes(2048, 64) + norms_bytes(2048),
        token_bytes=dsv2l_attn + swiglu_bytes(2048, 10944, BF16) + norms_bytes(2048) + output_bytes(102400, 2048),
        source="config.json of deepseek-ai/DeepSeek-V2-Lite (bf16; 1 dense + 26 MoE layers)"))

    # Qwen/Qwen3-30B-A3B config.json: num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
    # hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
    # head_dim=128 (q_norm, k_norm of 128 each), vocab_size=151936, tie_word_embeddings=false,
    # torch_dtype=bfloat16, mlp_only_layers=[] (every layer MoE).
    presets.append(ModelProfile(
        name="qwen3-30b-a3b", num_layers=48, num_experts=128, top_k=8,
        expert_bytes=swiglu_bytes(2048, 768, BF16),
        expert_params=3 * 2048 * 768,
        layer_bytes=gqa_attention_bytes(2048, 32, 4, 128, BF16, extra_params=2 * 128)
        + router_bytes(2048, 128) + norms_bytes(2048),
        token_bytes=output_bytes(151936, 2048),
        source="config.json of Qwen/Qwen3-30B-A3B (bf16)"))

    # allenai/OLMoE-1B-7B-0924 config.json: num_hidden_layers=16, num_experts=64,
    # num_experts_per_tok=8, hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
    # num_key_value_heads=16 (head_dim 128; q_norm, k_norm over 2048 each), vocab_size=50304,
    # tie_word_embeddings=false, torch_dtype=bfloat16.
    presets.append(ModelProfile(
        name="olmoe-1b-7b", num_layers=16, num_experts=64, top_k=8,
        expert_bytes=swiglu_bytes(2048, 1024, BF16),
        expert_params=3 * 2048 * 1024,
        layer_bytes=gqa_attention_bytes(2048, 16, 16, 128, BF16, extra_params=2 * 2048)
        + router_bytes(2048, 64) + norms_bytes(2048),
        token_bytes=output_bytes(50304, 2048),
        source="config.json of allenai/OLMoE-1B-7B-0924 (bf16)"))

    # openai/gpt-oss-20b config.json: num_hidden_layers=24, num_local_experts=32,
    # num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
    # num_key_value_heads=8, head_dim=64, attention_bias=true (+ 64 attention sinks per layer),
    # vocab_size=201088, tie_word_embeddings=false. quantization_config: quant_method=mxfp4 on the
    # experts; self_attn, router, embed_tokens, lm_head kept in bf16 (modules_to_not_convert).
    # Expert biases (gate_up 2x2880, down 2880) are bf16; the router has a bias.
    presets.append(ModelProfile(
        name="gpt-oss-20b", num_layers=24, num_experts=32, top_k=4,
        expert_bytes=swiglu_bytes(2880, 2880, MXFP4, bias_bytes_per_param=BF16),
        expert_params=3 * 2880 * 2880,
        layer_bytes=gqa_attention_bytes(2880, 64, 8, 64, BF16, bias=True, extra_params=64)
        + router_bytes(2880, 32, bias=True) + norms_bytes(2880),
        token_bytes=output_bytes(201088, 2880),
        source="config.json of openai/gpt-oss-20b (MXFP4 experts, bf16 rest)"))

    # deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers=61, first_k_dense_replace=3 (dense
    # intermediate_size=18432), n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    # moe_intermediate_size=2048, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
    # kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    # vocab_size=129280, tie_word_embeddings=false; quantization_config fmt=e4m3 (FP8 linear
    # weights; router, norms, embedding, lm_head bf16). The 128x128 fp32 block scales (+0.02%) and
    # the multi-token-prediction layer (not used in plain decode) are left out.
    dsv3_attn = mla_attention_bytes(7168, 128, 1536, 512, 128, 64, 128, FP8)
    dsv3_dense = dsv3_attn + swiglu_bytes(7168, 18432, FP8) + norms_bytes(7168)
    presets.append(ModelProfile(
        name="deepseek-v3", num_layers=58, num_experts=256, top_k=8,
        expert_bytes=swiglu_bytes(7168, 2048, FP8),
        expert_params=3 * 7168 * 2048,
        layer_bytes=dsv3_attn + swiglu_bytes(7168, 2048, FP8) + router_bytes(7168, 256) + norms_bytes(7168),
        token_bytes=3 * dsv3_dense + output_bytes(129280, 7168),
        source="config.json of deepseek-ai/DeepSeek-V3 (FP8 weights; 3 dense + 58 MoE layers)"))

    # seqmoe-tiny, our own model (src/seqmoe/models/seqmoe-tiny/config.json, OLMoE architecture):
    # num_hidden_layers=8, num_experts=32, num_experts_per_tok=4, hidden_size=160,
    # intermediate_size=80 (per expert), num_attention_heads=5, num_key_value_heads=5 (head_dim 32;
    # q_norm, k_norm over 160 each), vocab_size=4096, tie_word_embeddings=true; stored 16-bit.
    presets.append(ModelProfile(
        name="seqmoe-tiny", num_layers=8, num_experts=32, top_k=4,
        expert_bytes=swiglu_bytes(160, 80, BF16),
        expert_params=3 * 160 * 80,
        layer_bytes=gqa_attention_bytes(160, 5, 5, 32, BF16, extra_params=2 * 160) + router_bytes(160, 32)
        + norms_bytes(160),
        token_bytes=output_bytes(4096, 160),
        source="config.json of seqmoe-tiny (16-bit weights, shipped in seqmoe/models)"))
    return {p.name: p for p in presets}


# docs/DESIGN.md ("Hardware and model facts"): per-copy overhead 10-30 us; we take the middle.
_ALPHA_S = 20e-6
# docs/DESIGN.md: effective pinned H2D over PCIe 4.0 x16 about 25 GB/s (32 GB/s raw per direction);
# PCIe 5.0 x16 about 50-57 GB/s (64 GB/s raw); we take the low end of each.
_PCIE4_H2D = 25e9
_PCIE5_H2D = 50e9
# Hosts (peak DRAM bandwidth = channels x MT/s x 8 bytes). Desktop: AMD Ryzen 9 7950X spec, 16
# cores, two channels of DDR5-5200 = 83.2 GB/s. Servers: AMD EPYC 9654 (Genoa) spec, 96 cores,
# twelve channels of DDR5-4800 = 460.8 GB/s; AMD EPYC 7763 (Milan), 64 cores, eight channels of
# DDR4-3200 = 204.8 GB/s (the figures AMD's EDAC patches implied, as Tom's Hardware reported them).
_DESKTOP = dict(host_memory_bytes_per_s=2 * 5200e6 * 8, host_cores=16)
_GENOA = dict(host_memory_bytes_per_s=12 * 4800e6 * 8, host_cores=96)
_MILAN = dict(host_memory_bytes_per_s=8 * 3200e6 * 8, host_cores=64)


def _hardware_presets() -> dict[str, HardwareProfile]:
    presets = [
        # NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X, 384-bit at 21 Gbps = 1008 GB/s,
        # PCIe 4.0 x16 host interface.
        HardwareProfile(name="rtx4090-pcie4", h2d_bytes_per_s=_PCIE4_H2D, copy_overhead_s=_ALPHA_S,
                        hbm_bytes_per_s=1008e9, device_memory_bytes=24 * 10**9, **_DESKTOP,
                        source="NVIDIA RTX 4090 spec (1008 GB/s, 24 GB); PCIe 4.0 x16 ~25 GB/s effective; "
                               "desktop host: Ryzen 9 7950X, 2 x DDR5-5200"),
        # NVIDIA A100 datasheet, A100 80GB PCIe: 80 GB HBM2e, 1,935 GB/s, PCIe Gen4 (64 GB/s bidirectional).
        HardwareProfile(name="a100-pcie4", h2d_bytes_per_s=_PCIE4_H2D, copy_overhead_s=_ALPHA_S,
                        hbm_bytes_per_s=1935e9, device_memory_bytes=80 * 10**9, **_MILAN,
                        source="NVIDIA A100 datasheet, 80GB PCIe (1935 GB/s); PCIe 4.0 x16 ~25 GB/s effective; "
                               "server host: EPYC 7763, 8 x DDR4-3200"),
        # NVIDIA H100 datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s; host link PCIe Gen5 (128 GB/s bidirectional).
        HardwareProfile(name="h100-pcie5", h2d_bytes_per_s=_PCIE5_H2D, copy_overhead_s=_ALPHA_S,
                        hbm_bytes_per_s=3.35e12, device_memory_bytes=80 * 10**9, **_GENOA,
                        source="NVIDIA H100 datasheet, SXM5 80GB (3.35 TB/s); PCIe 5.0 x16 ~50 GB/s effective; "
                               "server host: EPYC 9654, 12 x DDR5-4800"),
        # NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s; host link PCIe Gen5 (128 GB/s bidirectional).
        HardwareProfile(name="h200-pcie5", h2d_bytes_per_s=_PCIE5_H2D, copy_overhead_s=_ALPHA_S,
                        hbm_bytes_per_s=4.8e12, device_memory_bytes=141 * 10**9, **_GENOA,
                        source="NVIDIA H200 datasheet (141 GB, 4.8 TB/s); PCIe 5.0 x16 ~50 GB/s effective; "
                               "server host: EPYC 9654, 12 x DDR5-4800"),
    ]
    return {p.name: p for p in presets}


MODEL_PROFILES: dict[str, ModelProfile] = _model_presets()
"""Model presets by name."""
HARDWARE_PROFILES: dict[str, HardwareProfile] = _hardware_presets()
"""Hardware presets by name."""


# ---- lookup -------------------------------------------------------------------------------------


def get_model_profile(name_or_path: str | Path) -> ModelProfile:
    """A preset by name (see `MODEL_PROFILES`), or a profile read from a .json/.toml file of its fields."""
    return _get(ModelProfile, MODEL_PROFILES, "model", name_or_path)


def get_hardware_profile(name_or_path: str | Path) -> HardwareProfile:
    """A preset by name (see `HARDWARE_PROFILES`), or a profile read from a .json/.toml file of its fields."""
    return _get(HardwareProfile, HARDWARE_PROFILES, "hardware", name_or_path)


def _get(cls, presets: dict, kind: str, name_or_path):
    key = str(name_or_path)
    if key in presets:
        return presets[key]
    path = Path(key)
    if path.suffix.lower() in (".json", ".toml"):
        if not path.is_file():
            raise UserError(f"{kind} profile file '{path}' not found")
        return _from_file(cls, kind, path)
    raise UserError(f"unknown {kind} profile '{key}'; choose one of: {', '.join(presets)}, or give a .json/.toml file")


def _from_file(cls, kind: str, path: Path):
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(path.read_text())
        else:
            data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"cannot read {kind} profile '{path}': {e}") from e
    if not isinstance(data, dict):
        raise UserError(f"{kind} profile '{path}' must hold a table/object of fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UserError(f"{kind} profile '{path}': unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    missing = [n for n, f in fields.items()
               if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise UserError(f"{kind} profile '{path}': missing required field(s) {', '.join(missing)}")
    data.setdefault("name", path.stem)
    # JSON writers often emit 1.7e7 for byte counts; accept whole floats where an int is expected.
    for n, v in data.items():
        if fields[n].type in ("int", "int | None") and isinstance(v, float) and v.is_integer():
            data[n] = int(v)
    return cls(**data)

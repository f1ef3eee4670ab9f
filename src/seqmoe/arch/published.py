"""The published shapes of real MoE models, built with seeded random weights (the real-size harness,
`seqmoe.runtime.timing.forced`): what copying and computing their experts costs does not depend on the
weights' values.

    model = build_model("deepseek-v2-lite")                          # 15.7 B parameters, all 27 layers
    model = build_model("mixtral-8x7b", width_divisor=16, num_layers=4)   # the CPU version
"""

from __future__ import annotations

import dataclasses

import torch

from seqmoe.base.errors import UserError


@dataclasses.dataclass(frozen=True)
class RealArch:
    model_type: str
    config: dict
    width: tuple[str, ...]
    """Config fields divided by `width_divisor` (layer and expert counts never are)."""
    source: str


ARCHS: dict[str, RealArch] = {
    "deepseek-v2-lite": RealArch(
        "deepseek_v2",
        dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
             num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64, n_shared_experts=2,
             num_experts_per_tok=6, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
             routed_scaling_factor=1.0, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
        ("hidden_size", "intermediate_size", "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim",
         "qk_rope_head_dim", "v_head_dim"),
        "config.json of deepseek-ai/DeepSeek-V2-Lite (26 MoE layers after one dense layer, 64 experts, top-6, "
        "2 shared experts)"),
    "mixtral-8x7b": RealArch(
        "mixtral",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_local_experts=8,
             num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False),
        ("hidden_size", "intermediate_size", "head_dim"),
        "config.json of mistralai/Mixtral-8x7B-v0.1 (32 layers, 8 experts, top-2)"),
}


def build_model(arch: str, *, width_divisor: int = 1, num_layers: int | None = None, vocab_size: int | None = None,
                seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A transformers causal LM of `arch`'s architecture with seeded random weights, built on `device`.

    Args:
        width_divisor: divide the hidden sizes by this (the CPU version; 1 = the real size).
        num_layers: keep only the first decoder layers (host memory; default all).
        vocab_size: default the real one.
    """
    from transformers import AutoModelForCausalLM  # transformers: only when this runs

    config = real_config(arch, width_divisor=width_divisor, num_layers=num_layers, vocab_size=vocab_size)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def real_config(arch: str, *, width_divisor: int = 1, num_layers: int | None = None, vocab_size: int | None = None):
    """The transformers config of `arch` (`build_model`'s arguments)."""
    if arch not in ARCHS:
        raise UserError(f"unknown architecture {arch!r}; choose from: {', '.join(ARCHS)}")
    if width_divisor < 1 or (num_layers is not None and num_layers < 1):
        raise UserError(f"need width_divisor >= 1 and num_layers >= 1 (got {width_divisor}, {num_layers})")
    from transformers import AutoConfig  # transformers: only when this runs

    spec = ARCHS[arch]
    kw = dict(spec.config)
    for key in spec.width:
        kw[key] = max(2, kw[key] // width_divisor)
    if num_layers is not None:
        kw["num_hidden_layers"] = min(num_layers, kw["num_hidden_layers"])
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    return AutoConfig.for_model(spec.model_type, **kw)

"""Tiny randomly initialised transformers MoE models, one per supported architecture.

    model = tiny_model("deepseek_v3")   # eval mode, fp32, 3 decoder layers, 8 experts, top-2

Every model has vocab 128, hidden 32, 8 routed experts and top-2 routing. Router weights are
redrawn with std 1 (the default 0.02 leaves near-ties that flip under float noise), and
DeepSeek-V3's `e_score_correction_bias` is random so that it changes the choice.
"""

from __future__ import annotations

import torch

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
"""Architectures `tiny_model` builds (transformers' `model_type` names)."""

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, num_experts_per_tok=2, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
_DEEPSEEK = dict(
    num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16,
    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
    num_key_value_heads=4,  # as in the real models: MLA's keys have every head (2 breaks a padded batch's mask)
)
_CONFIGS: dict[str, dict] = {
    "mixtral": dict(num_hidden_layers=3, num_local_experts=8, head_dim=8),
    "qwen2_moe": dict(num_hidden_layers=3, num_experts=8, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_hidden_layers=3, num_experts=8, moe_intermediate_size=16, head_dim=8,
                      norm_topk_prob=True),
    "olmoe": dict(num_hidden_layers=3, num_experts=8),
    "deepseek_v2": dict(_DEEPSEEK, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5),
    "deepseek_v3": dict(_DEEPSEEK, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                        rope_interleave=True),
    "gpt_oss": dict(num_hidden_layers=3, num_local_experts=8, head_dim=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters=dict(rope_type="yarn", factor=2.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=128, rope_theta=150000.0)),
}


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised `*ForCausalLM` of `arch` (one of `ARCHS`), in eval mode, fp32, on CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {', '.join(ARCHS)}")
    config = AutoConfig.for_model(arch, **{**_COMMON, **_CONFIGS[arch]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__.lower().endswith("router"):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
                bias = getattr(module, "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(torch.rand(bias.shape, generator=gen) * 0.5)
    return model.eval()


def tiny_dense_model(seed: int = 0) -> torch.nn.Module:
    """A tiny LlamaForCausalLM: a causal LM without MoE layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**dict(_COMMON, num_hidden_layers=2, head_dim=8))
    config.num_experts_per_tok = None
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tiny_tokenizer():
    """A character-level fast tokenizer (ids < 100, within `VOCAB`) that prepends `<s>` (id 1)."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def save_tiny_checkpoint(arch: str, path, *, tokenizer: bool = True, seed: int = 0):
    """Save `tiny_model(arch)` (or `tiny_dense_model()` for arch="llama") and optionally `tiny_tokenizer()` to `path`."""
    model = tiny_dense_model(seed) if arch == "llama" else tiny_model(arch, seed)
    model.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return model

"""The preset profiles and the arithmetic behind them: each model's bytes from its config.json,
each machine's figures from its published specifications (every number cites its source).
`seqmoe.costs.profiles` builds `MODEL_PROFILES` and `HARDWARE_PROFILES` from these fields.
"""

from __future__ import annotations

from seqmoe.costs.precision import matrix_bytes

BF16 = 2
"""Bytes per bf16 parameter."""
FP8 = 1
"""Bytes per FP8 (e4m3) parameter."""
MXFP4 = 17 / 32
"""Bytes per MXFP4 parameter: 4-bit values plus one 8-bit scale per 32 values = 4.25 bits."""
Q4_K = 144 / 256
"""Bytes per GGUF Q4_K parameter: 144 bytes per super-block of 256 = 4.5 bits."""
FLOP = 2
"""FLOPs per weight per position (a multiply and an add): a part's FLOPs per position are its byte
helper below evaluated at 2 "bytes" per parameter, whatever the weights' storage (norm and bias
vectors count alike, a rounding error beside the matrices). Attention's score FLOPs, which grow with
the context, are left out (DeepSeek-V2-Lite at 2,048 positions: about 6 % of a position's FLOPs)."""




def swiglu_shapes(hidden: int, inter: int) -> tuple[tuple[int, int], ...]:
    """[outputs, inputs] of a SwiGLU expert's gate, up and down matrices as checkpoints store them."""
    return ((inter, hidden), (inter, hidden), (hidden, inter))


def shipped_expert_bytes(shapes, precision: str, vector_bytes: int = 0) -> int:
    """Bytes of one expert whose matrices `shapes` a checkpoint stores at shipped `precision`, + `vector_bytes`."""
    return sum(matrix_bytes(a, b, precision) for a, b in shapes) + vector_bytes


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


GPT_OSS_SHAPES = ((2 * 2880, 2880), (2880, 2880))
"""gpt-oss's expert matrices as its file stores them: gate and up fused ([2 x 2880, 2880] in MXFP4 blocks
of 32 inputs), down [2880, 2880]."""


def model_presets() -> list[dict]:
    presets = []

    # mistralai/Mixtral-8x7B-v0.1 config.json: num_hidden_layers=32, num_local_experts=8,
    # num_experts_per_tok=2, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
    # num_key_value_heads=8 (head_dim 4096/32=128), vocab_size=32000, tie_word_embeddings=false,
    # torch_dtype=bfloat16. Every layer is MoE.
    presets.append(dict(
        name="mixtral-8x7b", num_layers=32, num_experts=8, top_k=2,
        expert_bytes=swiglu_bytes(4096, 14336, BF16),
        expert_params=3 * 4096 * 14336,
        expert_shapes=swiglu_shapes(4096, 14336),
        layer_bytes=gqa_attention_bytes(4096, 32, 8, 128, BF16) + router_bytes(4096, 8) + norms_bytes(4096),
        token_bytes=output_bytes(32000, 4096),
        layer_flops=gqa_attention_bytes(4096, 32, 8, 128, FLOP) + router_bytes(4096, 8, FLOP) + norms_bytes(4096, 2, FLOP),
        head_flops=FLOP * 32000 * 4096,
        source="config.json of mistralai/Mixtral-8x7B-v0.1 (bf16)"))

    # deepseek-ai/DeepSeek-V2-Lite config.json: num_hidden_layers=27, first_k_dense_replace=1
    # (layer 0 dense, intermediate_size=10944), n_routed_experts=64, num_experts_per_tok=6,
    # n_shared_experts=2, moe_intermediate_size=1408, hidden_size=2048, num_attention_heads=16,
    # q_lora_rank=null, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    # v_head_dim=128, vocab_size=102400, tie_word_embeddings=false, torch_dtype=bfloat16.
    dsv2l_attn = mla_attention_bytes(2048, 16, None, 512, 128, 64, 128, BF16)
    dsv2l_attn_f = mla_attention_bytes(2048, 16, None, 512, 128, 64, 128, FLOP, FLOP)
    presets.append(dict(
        name="deepseek-v2-lite", num_layers=26, num_experts=64, top_k=6,
        expert_bytes=swiglu_bytes(2048, 1408, BF16),
        expert_params=3 * 2048 * 1408,
        expert_shapes=swiglu_shapes(2048, 1408),
        layer_bytes=dsv2l_attn + 2 * swiglu_bytes(2048, 1408, BF16) + router_bytes(2048, 64) + norms_bytes(2048),
        token_bytes=dsv2l_attn + swiglu_bytes(2048, 10944, BF16) + norms_bytes(2048) + output_bytes(102400, 2048),
        layer_flops=dsv2l_attn_f + 2 * swiglu_bytes(2048, 1408, FLOP) + router_bytes(2048, 64, FLOP)
        + norms_bytes(2048, 2, FLOP),
        token_flops=dsv2l_attn_f + swiglu_bytes(2048, 10944, FLOP) + norms_bytes(2048, 2, FLOP),
        head_flops=FLOP * 102400 * 2048,
        source="config.json of deepseek-ai/DeepSeek-V2-Lite (bf16; 1 dense + 26 MoE layers)"))

    # Qwen/Qwen3-30B-A3B config.json: num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
    # hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
    # head_dim=128 (q_norm, k_norm of 128 each), vocab_size=151936, tie_word_embeddings=false,
    # torch_dtype=bfloat16, mlp_only_layers=[] (every layer MoE).
    presets.append(dict(
        name="qwen3-30b-a3b", num_layers=48, num_experts=128, top_k=8,
        expert_bytes=swiglu_bytes(2048, 768, BF16),
        expert_params=3 * 2048 * 768,
        expert_shapes=swiglu_shapes(2048, 768),
        layer_bytes=gqa_attention_bytes(2048, 32, 4, 128, BF16, extra_params=2 * 128)
        + router_bytes(2048, 128) + norms_bytes(2048),
        token_bytes=output_bytes(151936, 2048),
        layer_flops=gqa_attention_bytes(2048, 32, 4, 128, FLOP, extra_params=2 * 128)
        + router_bytes(2048, 128, FLOP) + norms_bytes(2048, 2, FLOP),
        head_flops=FLOP * 151936 * 2048,
        source="config.json of Qwen/Qwen3-30B-A3B (bf16)"))

    # allenai/OLMoE-1B-7B-0924 config.json: num_hidden_layers=16, num_experts=64,
    # num_experts_per_tok=8, hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
    # num_key_value_heads=16 (head_dim 128; q_norm, k_norm over 2048 each), vocab_size=50304,
    # tie_word_embeddings=false, torch_dtype=bfloat16.
    presets.append(dict(
        name="olmoe-1b-7b", num_layers=16, num_experts=64, top_k=8,
        expert_bytes=swiglu_bytes(2048, 1024, BF16),
        expert_params=3 * 2048 * 1024,
        expert_shapes=swiglu_shapes(2048, 1024),
        layer_bytes=gqa_attention_bytes(2048, 16, 16, 128, BF16, extra_params=2 * 2048)
        + router_bytes(2048, 64) + norms_bytes(2048),
        token_bytes=output_bytes(50304, 2048),
        layer_flops=gqa_attention_bytes(2048, 16, 16, 128, FLOP, extra_params=2 * 2048)
        + router_bytes(2048, 64, FLOP) + norms_bytes(2048, 2, FLOP),
        head_flops=FLOP * 50304 * 2048,
        source="config.json of allenai/OLMoE-1B-7B-0924 (bf16)"))

    # openai/gpt-oss-20b config.json: num_hidden_layers=24, num_local_experts=32,
    # num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
    # num_key_value_heads=8, head_dim=64, attention_bias=true (+ 64 attention sinks per layer),
    # vocab_size=201088, tie_word_embeddings=false. quantization_config: quant_method=mxfp4 on the
    # experts; self_attn, router, embed_tokens, lm_head kept in bf16 (modules_to_not_convert).
    # Expert biases (gate_up 2x2880, down 2880) are bf16; the router has a bias.
    presets.append(dict(
        name="gpt-oss-20b", num_layers=24, num_experts=32, top_k=4,
        expert_bytes=swiglu_bytes(2880, 2880, MXFP4, bias_bytes_per_param=BF16),
        expert_params=3 * 2880 * 2880,
        expert_shapes=GPT_OSS_SHAPES,
        layer_bytes=gqa_attention_bytes(2880, 64, 8, 64, BF16, bias=True, extra_params=64)
        + router_bytes(2880, 32, bias=True) + norms_bytes(2880),
        token_bytes=output_bytes(201088, 2880),
        layer_flops=gqa_attention_bytes(2880, 64, 8, 64, FLOP, bias=True, extra_params=64)
        + router_bytes(2880, 32, FLOP, bias=True) + norms_bytes(2880, 2, FLOP),
        head_flops=FLOP * 201088 * 2880,
        source="config.json of openai/gpt-oss-20b (MXFP4 experts, bf16 rest)"))

    # openai/gpt-oss-120b config.json: as gpt-oss-20b but num_hidden_layers=36, num_local_experts=128
    # (num_experts_per_tok=4, hidden_size=intermediate_size=2880, 64 heads, 8 KV heads of 64).
    presets.append(dict(
        name="gpt-oss-120b", num_layers=36, num_experts=128, top_k=4,
        expert_bytes=shipped_expert_bytes(GPT_OSS_SHAPES, "mxfp4", vector_bytes=3 * 2880 * BF16),
        expert_params=3 * 2880 * 2880,
        expert_shapes=GPT_OSS_SHAPES,
        layer_bytes=gqa_attention_bytes(2880, 64, 8, 64, BF16, bias=True, extra_params=64)
        + router_bytes(2880, 128, bias=True) + norms_bytes(2880),
        token_bytes=output_bytes(201088, 2880),
        layer_flops=gqa_attention_bytes(2880, 64, 8, 64, FLOP, bias=True, extra_params=64)
        + router_bytes(2880, 128, FLOP, bias=True) + norms_bytes(2880, 2, FLOP),
        head_flops=FLOP * 201088 * 2880,
        source="config.json of openai/gpt-oss-120b (MXFP4 experts, bf16 rest)"))

    # Qwen/Qwen3-30B-A3B-FP8: Qwen3-30B-A3B's shapes (above) with quantization_config quant_method=fp8,
    # fmt=e4m3, weight_block_size=[128, 128]: the linear weights of attention and experts are FP8 with a
    # float32 scale per 128 x 128 block; router, norms, embedding and lm_head stay bf16. The attention
    # projections' block scales (+0.02 %) are left out.
    qwen3_fp8_attn = gqa_attention_bytes(2048, 32, 4, 128, FP8) + 2 * 128 * BF16
    presets.append(dict(
        name="qwen3-30b-a3b-fp8", num_layers=48, num_experts=128, top_k=8,
        expert_bytes=shipped_expert_bytes(swiglu_shapes(2048, 768), "fp8-block"),
        expert_params=3 * 2048 * 768,
        expert_shapes=swiglu_shapes(2048, 768),
        layer_bytes=qwen3_fp8_attn + router_bytes(2048, 128) + norms_bytes(2048),
        token_bytes=output_bytes(151936, 2048),
        layer_flops=gqa_attention_bytes(2048, 32, 4, 128, FLOP, extra_params=2 * 128)
        + router_bytes(2048, 128, FLOP) + norms_bytes(2048, 2, FLOP),
        head_flops=FLOP * 151936 * 2048,
        source="config.json of Qwen/Qwen3-30B-A3B-FP8 (FP8 128x128 blocks; router, norms, embeddings bf16)"))

    # DeepSeek-V2-Lite as a Q4_K GGUF (llama.cpp's llama-quantize): the experts' gate and up matrices in
    # Q4_K; down ([2048, 1408]: 1408 inputs are not a multiple of Q4_K's 256) falls back to Q5_0, as
    # llama.cpp does for such a tensor. The rest is priced at Q4_K's 4.5 bits (a Q4_K_M file keeps some
    # tensors at Q6_K and norms at f32: a rounding error beside the experts); shapes as deepseek-v2-lite.
    dsv2l_q4_attn = mla_attention_bytes(2048, 16, None, 512, 128, 64, 128, Q4_K)
    dsv2l_q4_shared = 2 * shipped_expert_bytes(swiglu_shapes(2048, 1408)[:2], "q4_k") + 2 * matrix_bytes(2048, 1408, "q5_0")
    presets.append(dict(
        name="deepseek-v2-lite-q4_k", num_layers=26, num_experts=64, top_k=6,
        expert_bytes=shipped_expert_bytes(swiglu_shapes(2048, 1408)[:2], "q4_k") + matrix_bytes(2048, 1408, "q5_0"),
        expert_params=3 * 2048 * 1408,
        layer_bytes=dsv2l_q4_attn + dsv2l_q4_shared + router_bytes(2048, 64) + norms_bytes(2048),
        token_bytes=dsv2l_q4_attn + swiglu_bytes(2048, 10944, Q4_K) + norms_bytes(2048) + output_bytes(102400, 2048, Q4_K),
        layer_flops=dsv2l_attn_f + 2 * swiglu_bytes(2048, 1408, FLOP) + router_bytes(2048, 64, FLOP)
        + norms_bytes(2048, 2, FLOP),
        token_flops=dsv2l_attn_f + swiglu_bytes(2048, 10944, FLOP) + norms_bytes(2048, 2, FLOP),
        head_flops=FLOP * 102400 * 2048,
        source="DeepSeek-V2-Lite's config.json in a Q4_K GGUF (experts: gate, up Q4_K; down Q5_0, llama.cpp's fallback)"))

    # deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers=61, first_k_dense_replace=3 (dense
    # intermediate_size=18432), n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    # moe_intermediate_size=2048, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
    # kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    # vocab_size=129280, tie_word_embeddings=false; quantization_config fmt=e4m3 (FP8 linear
    # weights with weight_block_size [128, 128]; router, norms, embedding, lm_head bf16). The experts'
    # fp32 block scales are counted; the dense part's (+0.02 %) and the multi-token-prediction layer (not
    # used in plain decode) are left out.
    dsv3_attn = mla_attention_bytes(7168, 128, 1536, 512, 128, 64, 128, FP8)
    dsv3_dense = dsv3_attn + swiglu_bytes(7168, 18432, FP8) + norms_bytes(7168)
    dsv3_attn_f = mla_attention_bytes(7168, 128, 1536, 512, 128, 64, 128, FLOP, FLOP)
    presets.append(dict(
        name="deepseek-v3", num_layers=58, num_experts=256, top_k=8,
        expert_bytes=shipped_expert_bytes(swiglu_shapes(7168, 2048), "fp8-block"),
        expert_params=3 * 7168 * 2048,
        expert_shapes=swiglu_shapes(7168, 2048),
        layer_bytes=dsv3_attn + swiglu_bytes(7168, 2048, FP8) + router_bytes(7168, 256) + norms_bytes(7168),
        token_bytes=3 * dsv3_dense + output_bytes(129280, 7168),
        layer_flops=dsv3_attn_f + swiglu_bytes(7168, 2048, FLOP) + router_bytes(7168, 256, FLOP)
        + norms_bytes(7168, 2, FLOP),
        token_flops=3 * (dsv3_attn_f + swiglu_bytes(7168, 18432, FLOP) + norms_bytes(7168, 2, FLOP)),
        head_flops=FLOP * 129280 * 7168,
        source="config.json of deepseek-ai/DeepSeek-V3 (FP8 weights; 3 dense + 58 MoE layers)"))

    # seqmoe-tiny, our own model (src/seqmoe/models/seqmoe-tiny/config.json, OLMoE architecture):
    # num_hidden_layers=8, num_experts=32, num_experts_per_tok=4, hidden_size=160,
    # intermediate_size=80 (per expert), num_attention_heads=5, num_key_value_heads=5 (head_dim 32;
    # q_norm, k_norm over 160 each), vocab_size=4096, tie_word_embeddings=true; stored 16-bit.
    presets.append(dict(
        name="seqmoe-tiny", num_layers=8, num_experts=32, top_k=4,
        expert_bytes=swiglu_bytes(160, 80, BF16),
        expert_params=3 * 160 * 80,
        expert_shapes=swiglu_shapes(160, 80),
        layer_bytes=gqa_attention_bytes(160, 5, 5, 32, BF16, extra_params=2 * 160) + router_bytes(160, 32)
        + norms_bytes(160),
        token_bytes=output_bytes(4096, 160),
        layer_flops=gqa_attention_bytes(160, 5, 5, 32, FLOP, extra_params=2 * 160) + router_bytes(160, 32, FLOP)
        + norms_bytes(160, 2, FLOP),
        head_flops=FLOP * 4096 * 160,
        source="config.json of seqmoe-tiny (16-bit weights, shipped in seqmoe/models)"))
    return presets


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
# A host's bf16 FLOP rate in expert matmuls of many rows: its cores x the rate one core sustained on
# our 2-core development VM (AMD EPYC Zen 4, avx512_bf16, torch 2.13 CPU): one DeepSeek-V2-Lite
# expert (2048 x 1408 SwiGLU) at 256-1024 rows ran 405-416 GFLOP/s on 2 threads, 190 on 1
# (docs/LOG.md, issue 28). Milan (Zen 3) has no bf16 dot-product instructions; we scale it alike,
# which flatters it.
_CORE_FLOPS = 200e9
_DESKTOP = dict(host_memory_bytes_per_s=2 * 5200e6 * 8, host_cores=16, host_flops_per_s=16 * _CORE_FLOPS)
_GENOA = dict(host_memory_bytes_per_s=12 * 4800e6 * 8, host_cores=96, host_flops_per_s=96 * _CORE_FLOPS)
_MILAN = dict(host_memory_bytes_per_s=8 * 3200e6 * 8, host_cores=64, host_flops_per_s=64 * _CORE_FLOPS)
# Prompt GEMMs reach about half the dense bf16 peak: measured on an H200 (torch 2.11 cuBLAS, one
# DeepSeek-V2-Lite expert's SwiGLU at 2,048 rows: 0.50 of 989.4 TFLOP/s; dense 2048 x 2048 x 3072 to
# 10944: 0.66-0.73). Fewer rows per expert reach less (192 rows: 0.17), so the model flatters small
# groups, full load and offloaded alike.
_COMPUTE_EFFICIENCY = 0.5
# The disk holding the checkpoint (issue 29). PCIe 4 profiles: a Samsung 990 Pro (spec: 7,450 MB/s
# sequential read; WD SN850X 7,300); PCIe 5 profiles: a Crucial T705 (spec: 14,500 MB/s; Samsung
# 9100 Pro 14,700). An expert read (~17 MB at a random offset) is one large request split into
# >= 1 MiB parts in flight together; we assume 0.85 of the rated sequential figure for it (an
# assumption, not a measurement: benchmarks/disk_read.py measures a machine's), and NAND read
# latency ~80 us per read.
_PCIE4_DISK = dict(disk_bytes_per_s=0.85 * 7.45e9, disk_latency_s=80e-6)
_PCIE5_DISK = dict(disk_bytes_per_s=0.85 * 14.5e9, disk_latency_s=80e-6)
_PCIE4_DISK_SRC = "; disk: Samsung 990 Pro class PCIe 4 NVMe, 0.85 x 7.45 GB/s seq. read (assumed for 17 MB reads)"
_PCIE5_DISK_SRC = "; disk: Crucial T705 class PCIe 5 NVMe, 0.85 x 14.5 GB/s seq. read (assumed for 17 MB reads)"


def hardware_presets() -> list[dict]:
    presets = [
        # NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X, 384-bit at 21 Gbps = 1008 GB/s,
        # PCIe 4.0 x16 host interface; Ada whitepaper: 165.2 dense BF16 tensor TFLOPS (FP32 accumulate).
        dict(name="rtx4090-pcie4", h2d_bytes_per_s=_PCIE4_H2D, copy_overhead_s=_ALPHA_S,
                        hbm_bytes_per_s=1008e9, device_memory_bytes=24 * 10**9, **_DESKTOP,
                        device_flops_per_s=165.2e12, compute_efficiency=_COMPUTE_EFFICIENCY, **_PCIE4_DISK,
                        source="NVIDIA RTX 4090 spec (1008 GB/s, 24 GB); PCIe 4.0 x16 ~25 GB/s effective; "
                               "desktop host: Ryzen 9 7950X, 2 x DDR5-5200" + _PCIE4_DISK_SRC),
        # NVIDIA A100 datasheet, A100 80GB PCIe: 80 GB HBM2e, 1,935 GB/s, PCIe Gen4 (64 GB/s bidirectional),
        # BF16 tensor 312 TFLOPS dense (624 with sparsity).
        dict(name="a100-pcie4", h2d_bytes_per_s=_PCIE4_H2D, copy_overhead_s=_ALPHA_S,
                        hbm_bytes_per_s=1935e9, device_memory_bytes=80 * 10**9, **_MILAN,
                        device_flops_per_s=312e12, compute_efficiency=_COMPUTE_EFFICIENCY, **_PCIE4_DISK,
                        source="NVIDIA A100 datasheet, 80GB PCIe (1935 GB/s); PCIe 4.0 x16 ~25 GB/s effective; "
                               "server host: EPYC 7763, 8 x DDR4-3200" + _PCIE4_DISK_SRC),
        # NVIDIA H100 datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s; host link PCIe Gen5 (128 GB/s bidirectional);
        # BF16 tensor 1,979 TFLOPS with sparsity, 989.4 dense.
        dict(name="h100-pcie5", h2d_bytes_per_s=_PCIE5_H2D, copy_overhead_s=_ALPHA_S,
                        hbm_bytes_per_s=3.35e12, device_memory_bytes=80 * 10**9, **_GENOA,
                        device_flops_per_s=989.4e12, compute_efficiency=_COMPUTE_EFFICIENCY, **_PCIE5_DISK,
                        source="NVIDIA H100 datasheet, SXM5 80GB (3.35 TB/s); PCIe 5.0 x16 ~50 GB/s effective; "
                               "server host: EPYC 9654, 12 x DDR5-4800" + _PCIE5_DISK_SRC),
        # NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s; host link PCIe Gen5 (128 GB/s bidirectional);
        # BF16 tensor 1,979 TFLOPS with sparsity, 989.4 dense.
        dict(name="h200-pcie5", h2d_bytes_per_s=_PCIE5_H2D, copy_overhead_s=_ALPHA_S,
                        hbm_bytes_per_s=4.8e12, device_memory_bytes=141 * 10**9, **_GENOA,
                        device_flops_per_s=989.4e12, compute_efficiency=_COMPUTE_EFFICIENCY, **_PCIE5_DISK,
                        source="NVIDIA H200 datasheet (141 GB, 4.8 TB/s); PCIe 5.0 x16 ~50 GB/s effective; "
                               "server host: EPYC 9654, 12 x DDR5-4800" + _PCIE5_DISK_SRC),
    ]
    return presets

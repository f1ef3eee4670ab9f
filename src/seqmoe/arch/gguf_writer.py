"""Write a transformers Qwen2/3-MoE model as llama.cpp's converter lays it out in a GGUF file: its
metadata, every tensor under its GGUF name, the routed experts as [E, rows, row bytes] blocks in the
formats given (`seqmoe.arch.shipped`'s encoders). The tests' reference files and the llama.cpp
benchmark's model (`benchmarks/llama_cpp.py`) are written by it. Needs gguf-py (`pip install 'seqmoe[gguf]'`).

    write_gguf(model, "model.gguf", formats=("q8_0", "q8_0", "q8_0"), tokenizer=True)
"""

from __future__ import annotations

from pathlib import Path

from seqmoe.arch.shipped import SHIPPED_CODECS


def write_gguf(model, path, formats=("q4_k", "q4_k", "q8_0"), arch: str = "qwen3moe", last_down: str | None = None,
               tokenizer: bool = False) -> Path:
    """Write `model` (a transformers Qwen3-MoE) to `path`; returns it.

    Args:
        formats: the experts' gate, up and down formats (`SHIPPED_CODECS` names, or "f16").
        arch: the GGUF architecture name written (another one makes a file seqmoe must refuse).
        last_down: another format for the last layer's down matrices (a per-layer mix).
        tokenizer: also write a byte-level BPE of the 127 ASCII codes and one merge ("ab"), which
            transformers and llama.cpp read back; the model's vocabulary must hold its 128 tokens.
    """
    import gguf  # gguf-py: only when this runs

    c = model.config
    L, H, E, I = c.num_hidden_layers, c.hidden_size, c.num_experts, c.moe_intermediate_size
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([chr(i) if 32 <= i < 127 else f"<{i}>" for i in range(127)] + ["ab"])
        w.add_token_types([1] * 128)
        w.add_token_scores([0.0] * 128)
        w.add_token_merges(["a b"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(L)
    w.add_embedding_length(H)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(E)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(I)
    w.add_vocab_size(c.vocab_size)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3MOE, L)
    for name, p in model.state_dict().items():
        block = name.split(".")[2] if ".layers." in name else None
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            down = name.endswith("down_proj")
            parts = (("down", p),) if down else (("gate", p[:, :I]), ("up", p[:, I:]))
            for (which, part), fmt in zip(parts, formats[2:] if down else formats[:2]):
                fmt = last_down if down and last_down and int(block) == L - 1 else fmt
                raw = SHIPPED_CODECS[fmt].encode(part)[""].numpy() if fmt != "f16" else part.half().numpy()
                w.add_tensor(f"blk.{block}.ffn_{which}_exps.weight", raw, raw_dtype=gguf.GGMLQuantizationType[fmt.upper()])
            continue
        module, _, leaf = name.rpartition(".")
        w.add_tensor(f"{names.get_name(module)}.{leaf}", p.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)

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
    state = model.state_dict()

    def tensors(meta: bool):  # the infos' pass on meta copies: the experts are encoded once, for their data
        return ((k, v.to("meta")) for k, v in state.items()) if meta else state.items()

    return _write(model.config, path, tensors, formats, arch, last_down, tokenizer, dense="f32")


def write_random_gguf(config, path, formats=("q8_0", "q8_0", "q8_0"), seed: int = 0, progress: bool = False) -> Path:
    """Write a Qwen3-MoE of `config` with seeded random weights to `path` one tensor at a time, so the
    file may be bigger than memory (`write_gguf` holds the model): weights N(0, 0.02), norms 1,
    routers N(0, 1) (decided routing), matrices outside the experts in f16 as llama.cpp's converter
    writes them, and `write_gguf`'s tokenizer. Written beside `path` and renamed into it. Returns `path`."""
    import zlib

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(config).state_dict()

    def state(meta: bool):
        items = shapes.items()
        if progress and not meta:
            from tqdm import tqdm  # a progress bar over the tensors of a file that takes minutes

            items = tqdm(items, desc=f"writing {Path(path).name}", unit="tensor")
        for name, t in items:
            if meta:
                yield name, t
                continue
            gen = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
            if "norm" in name:
                yield name, torch.ones(t.shape)
            else:
                std = 1.0 if name.endswith("mlp.gate.weight") else 0.02
                yield name, torch.randn(t.shape, generator=gen) * std

    path = Path(path)
    part = path.with_name(path.name + ".part")  # a killed write leaves no file under `path`
    try:
        _write(config, part, state, formats, "qwen3moe", None, True, dense="f16")
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)
    return path


def _write(c, path, state, formats, arch, last_down, tokenizer, dense: str) -> Path:
    """Write the tensors `state(meta)` yields ((name, tensor) in transformers' names; with meta=True
    only their shapes count) under config `c`: their infos from a first pass, their data from a
    second, one tensor in memory at a time."""
    import gguf  # gguf-py: only when this runs
    import numpy as np

    L, I = c.num_hidden_layers, c.moe_intermediate_size
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3MOE, L)

    def tensors(meta: bool):
        for name, p in state(meta):
            block = name.split(".")[2] if ".layers." in name else None
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                down = name.endswith("down_proj")
                parts = (("down", p),) if down else (("gate", p[:, :I]), ("up", p[:, I:]))
                for (which, part), fmt in zip(parts, formats[2:] if down else formats[:2]):
                    fmt = last_down if down and last_down and int(block) == L - 1 else fmt
                    raw = SHIPPED_CODECS[fmt].encode(part)[""] if fmt != "f16" else part.half()
                    yield f"blk.{block}.ffn_{which}_exps.weight", raw, gguf.GGMLQuantizationType[fmt.upper()]
                continue
            module, _, leaf = name.rpartition(".")
            yield f"{names.get_name(module)}.{leaf}", p.half() if dense == "f16" and p.dim() > 1 else p.float(), None

    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, c, tokenizer)
    for name, t, raw in tensors(meta=True):
        dtype = np.dtype(str(t.dtype).removeprefix("torch."))  # float32, float16 or uint8 (blocks)
        w.add_tensor_info(name, tuple(t.shape), dtype, t.numel() * t.element_size(), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, t, _ in tensors(meta=False):
        w.write_tensor_data(t.contiguous().numpy())
    w.close()
    return Path(path)


def _metadata(w, c, tokenizer: bool) -> None:
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
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_vocab_size(c.vocab_size)

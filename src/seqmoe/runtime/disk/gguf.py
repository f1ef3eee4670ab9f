"""GGUF files (llama.cpp's): the model's config from the file's metadata, an index of its tensors for the
disk tier, and its dense tensors decoded as they are read; the routed experts stay in their own blocks.

    config = gguf_config(path)                 # a transformers config, as from_pretrained(gguf_file=) reads it
    index = gguf_index(path)                   # a CheckpointIndex over the file (tensors by GGUF name, raw bytes)
    t, n = gguf_dense(index, "model.norm.weight", reader, files)   # a dense tensor, dequantized, and its bytes read

Expert rows are planned by `checkpoint.ExpertFiles` (each expert's slice of `blk.N.ffn_{gate,up,down}_exps`);
their formats are `seqmoe.arch.shipped.gguf_precision`'s. gguf-py (llama.cpp's reader) parses the file and
dequantizes the dense tensors of any type; it is needed only when a GGUF file is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from seqmoe.arch.gguf_file import gguf_reader
from seqmoe.runtime.disk.index import CheckpointIndex, TensorEntry, _stat_key

_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def gguf_config(path: Path):
    """The transformers config of GGUF file `path`, as `from_pretrained(gguf_file=...)` reads it, plus the
    experts' width, which transformers' mapping leaves out (`{arch}.expert_feed_forward_length`)."""
    from transformers import AutoConfig  # transformers: only when this runs

    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    width = reader.fields.get(f"{arch}.expert_feed_forward_length")
    if width is not None and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(width.contents())
    return config


def gguf_index(path: Path) -> CheckpointIndex:
    """A `CheckpointIndex` of GGUF file `path`: each tensor by its GGUF name, as the file stores it
    (float tensors in their dtype, block-quantized ones as [..., row bytes] uint8), `index.gguf` the
    type name of each (e.g. "Q4_K"), `index.arch` the file's architecture."""
    reader = gguf_reader(path)
    tensors, types = {}, {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        dtype = _FLOAT.get(kind, torch.uint8)
        tensors[t.name] = TensorEntry(0, dtype, tuple(int(x) for x in t.data.shape), int(t.data_offset), int(t.n_bytes))
        types[t.name] = kind
    index = CheckpointIndex(path, [path], [_stat_key(os.stat(path))], tensors)
    index.gguf, index.arch = types, reader.fields["general.architecture"].contents()
    return index


def gguf_dense(index: CheckpointIndex, name: str, reader, files: dict) -> tuple[torch.Tensor, int] | None:
    """Model tensor `name` (e.g. "model.layers.0.self_attn.q_proj.weight") from GGUF `index`, dequantized
    by gguf-py when block-quantized, and the bytes read for it; None when the file has no tensor of that name."""
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map, quants

    names = index.__dict__.get("_names")
    if names is None:  # gguf-py's own map of the architecture's tensor names, for the file's blocks
        arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == index.arch)
        blocks = 1 + max((int(k.split(".")[1]) for k in index.tensors if k.startswith("blk.")), default=0)
        names = index._names = get_tensor_name_map(arch, blocks)
    base, _, leaf = name.rpartition(".")
    mapped = names.get_name(base)
    key = f"{mapped}.{leaf}" if mapped else None
    if key not in index.tensors:
        return None
    raw = index.read_tensor(key, reader, files)
    kind = index.gguf[key]
    if kind in _FLOAT:
        return raw, raw.nbytes
    return torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType[kind]).copy()), raw.nbytes

"""A real-size checkpoint on disk with seeded random weights, written one decoder layer at a time.

    folder = write_checkpoint("deepseek-v2-lite", "ckpt/", dtype=torch.bfloat16)   # 31 GB, never all in memory

For models bigger than host memory (`seqmoe.load` streams their experts): the model is built on the
meta device, and each decoder layer's tensors are drawn, written to a shard of their own and freed,
so memory holds one layer at a time. Routed experts are written per expert under the names the
published checkpoints use (`{experts}.{e}.gate_proj.weight`, `up_proj`, `down_proj`: transformers
fuses them when it loads); the rest under the model's own names. Values: normal(0, 0.02) for
matrices, ones for norm weights, zeros for biases; routing is forced anyway (`forced`), and what
reading and computing an expert costs does not depend on the values. The folder appears whole or
not at all (written beside it, then renamed).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from seqmoe.arch import model_arch
from seqmoe.arch.published import real_config
from seqmoe.base.errors import UserError

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def write_checkpoint(arch: str, folder, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0, progress: bool = True,
                     **shape) -> Path:
    """Write `arch`'s model (`seqmoe.arch.published`; `shape`: `real_config`'s width_divisor,
    num_layers, vocab_size) to `folder`, sharded by decoder layer; the folder. UserError if it exists."""
    from transformers import AutoModelForCausalLM  # transformers: only when this runs


    folder = Path(folder)
    if folder.exists():
        raise UserError(f"{folder} exists; remove it or choose another folder")
    config = real_config(arch, **shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = {id(m): n for n, m in model.named_modules()}
    experts = {names[id(m.experts)] for m in model_arch(model).moe}
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, t in model.state_dict().items():
        m = _LAYER.search(name)
        groups.setdefault(int(m.group(1)) if m else -1, []).append((name, t))
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, keys = {}, sorted(groups)
    bar = _bar(len(keys), progress)
    try:
        for i, key in enumerate(keys):
            file = f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors"
            tensors = {}
            for name, meta in groups[key]:
                owner = name.rsplit(".", 1)[0]
                if owner in experts:
                    tensors.update(_per_expert(owner, name.rsplit(".", 1)[1], meta, gen, dtype))
                else:
                    tensors[name] = _draw(name, meta.shape, gen, meta.dtype)
            save_file(tensors, tmp / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            del tensors
            bar.update(1)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        config.save_pretrained(tmp)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return folder


def _draw(name: str, shape, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if "norm" in name and len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def _per_expert(owner: str, param: str, meta: torch.Tensor, gen: torch.Generator, dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of fused parameter `param` [E, ...] of experts module `owner`: per expert
    gate_proj and up_proj (the halves of gate_up_proj [E, 2I, H]) or down_proj; other parameters fused."""
    E = meta.shape[0]
    if param == "gate_up_proj":
        I = meta.shape[1] // 2  # noqa: E741
        out = {}
        for e in range(E):
            for part in ("gate_proj", "up_proj"):
                out[f"{owner}.{e}.{part}.weight"] = _draw("w", (I, meta.shape[2]), gen, dtype)
        return out
    if param == "down_proj":
        return {f"{owner}.{e}.down_proj.weight": _draw("w", tuple(meta.shape[1:]), gen, dtype) for e in range(E)}
    return {f"{owner}.{param}": _draw(param, tuple(meta.shape), gen, dtype)}


def _bar(total: int, show: bool):
    return tqdm(total=total, desc="writing layers", unit="layer", disable=not show)

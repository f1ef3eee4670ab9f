"""GGUF files (llama.cpp's) as far as the experts' layout goes: which file a path names, gguf-py's reader
of it, and the formats its routed experts are stored in (`gguf_precision`: `SHIPPED` names, one per
matrix when they differ). Loading the rest is `seqmoe.runtime.disk.gguf`'s.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from seqmoe.base.errors import UserError, needs_extra


def gguf_file(path) -> Path | None:
    """The GGUF file `path` names: itself, or the one .gguf file of a folder; None when there is none."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"{path} does not exist; give a GGUF file or a checkpoint folder")
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").is_file() else []
    if len(found) > 1:
        raise UserError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}); give one")
    return found[0] if found else None


GGUF_READS = {"Q8_0": "q8_0", "Q5_0": "q5_0", "Q4_K": "q4_k"}
"""The GGUF block types seqmoe keeps experts in (their `SHIPPED` names)."""
GGUF_MODELS = ("qwen2moe", "qwen3moe")
"""GGUF architectures whose tensors map to transformers' by name alone (llama's permutes q and k)."""


@functools.lru_cache(maxsize=4)
def _reader(path: str, stamp: tuple):
    from gguf import GGUFReader  # gguf-py: only when a GGUF file is read

    return GGUFReader(path)


def gguf_reader(path):
    """gguf-py's reader of GGUF file `path` (memory-mapped; kept while the file is unchanged)."""
    if importlib.util.find_spec("gguf") is None:
        raise needs_extra(f"reading {path} needs gguf-py, llama.cpp's reader", "gguf")
    st = Path(path).stat()
    try:
        return _reader(str(path), (st.st_size, st.st_mtime_ns, st.st_ino))
    except Exception as e:  # noqa: BLE001 - any failure to parse the file is the file's: say so, in one line
        raise UserError(f"{path} is not a GGUF file gguf-py reads ({type(e).__name__}: {e}); give a GGUF file "
                        "llama.cpp wrote") from None


def gguf_precision(path) -> str:
    """The routed experts' formats in GGUF file `path` (gate, up, down: one name when they agree, else
    "q4_k/q4_k/q5_0"); UserError for an architecture or block type seqmoe does not read, or formats that
    differ between layers (the runtime keeps one expert layout)."""
    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in GGUF_MODELS:
        raise UserError(f"{path} is a GGUF file of a {arch} model; seqmoe reads GGUF files of {', '.join(GGUF_MODELS)} "
                        "models (their safetensors releases load too)")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    layers = sorted({int(n.split(".")[1]) for n in types if n.endswith("_exps.weight")})
    kinds = {n: tuple(types.get(f"blk.{n}.ffn_{w}_exps.weight") for w in ("gate", "up", "down")) for n in layers}
    first = kinds[layers[0]] if layers else ()
    if not layers or None in first:
        raise UserError(f"{path} has no routed experts (blk.N.ffn_gate_exps / up / down); give a MoE model's GGUF file")
    for n in layers:
        if kinds[n] != first:
            raise UserError(f"{path} stores layer {n}'s experts as {'/'.join(kinds[n])} and layer {layers[0]}'s as "
                            f"{'/'.join(first)}; seqmoe keeps one expert layout in every layer: quantize it with "
                            "llama-quantize --pure")
    bad = [k for k in first if k not in GGUF_READS]
    if bad:
        raise UserError(f"{path} stores its experts as {'/'.join(first)}; seqmoe reads GGUF experts in "
                        f"{', '.join(GGUF_READS)}: quantize them to one of those (llama-quantize)")
    names = [GGUF_READS[k] for k in first]
    return names[0] if len(set(names)) == 1 else "/".join(names)

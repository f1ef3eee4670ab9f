"""Load a transformers MoE causal LM (and its tokenizer) from a local folder or the name `seqmoe-tiny`.

    model, tokenizer = load_model("seqmoe-tiny")          # the packaged model
    model, tokenizer = load_model("models/olmoe-tiny")    # any folder with config.json
    layers = moe_layers(model)                            # its MoE layers and routers

Nothing is downloaded: folders load with `local_files_only=True`. torch and transformers are the
`hf` extra (`pip install seqmoe[hf]`).
"""

from __future__ import annotations

import os
import sys

import torch

from seqmoe.arch.gguf_file import gguf_file
from seqmoe.arch import MoeLayer, moe_layers
from seqmoe.arch.model_dirs import DTYPES, has_tokenizer_files, resolve_model_dir
from seqmoe.arch.quant import converted_precision
from seqmoe.base.errors import UserError, needs_extra

__all__ = ["load_model", "moe_layers", "MoeLayer", "resolve_model_dir"]



def _import_hf():
    try:
        import transformers  # transformers: only when this runs
    except ImportError as e:
        raise needs_extra("loading a transformers model needs transformers", "hf", e) from None
    return torch, transformers


def load_model(
    name_or_path: str | os.PathLike, *, device: str | None = None, dtype: str = "auto", tokenizer: bool = True,
    progress: bool | None = None,
):
    """(model in eval mode, tokenizer or None) for a local folder or `seqmoe-tiny`.

    Args:
        device: torch device ("cpu", "cuda", ...); None: cuda when available, else cpu.
        dtype: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".
        tokenizer: also load the folder's tokenizer; None when the folder has no tokenizer files.
        progress: show transformers' loading bar (default: when stderr is a terminal).

    Raises:
        UserError: a missing folder or config, a checkpoint that does not load, a model without MoE layers.
    """
    torch, transformers = _import_hf()
    path = resolve_model_dir(name_or_path)
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if converted_precision(path):
        raise UserError(f"{path} holds routed experts converted by seqmoe convert, which transformers does not "
                        "read: load it with seqmoe.load (seqmoe generate/serve do), or use the original checkpoint")
    if gguf_file(path) is not None:
        raise UserError(f"{path} is a GGUF file, which transformers would dequantize whole: load it with seqmoe.load "
                        "(seqmoe generate/serve do), which keeps its experts in their blocks")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    bars = transformers.utils.logging
    shown = bars.is_progress_bar_enabled()
    if shown and not (sys.stderr.isatty() if progress is None else progress):
        bars.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
        )
    except (OSError, ValueError, KeyError) as e:
        msg = " ".join(str(e).split())[:300]
        raise UserError(f"cannot load a causal LM from {path}: {msg}") from None
    finally:
        if shown:
            bars.enable_progress_bar()
    model.to(device).eval()
    moe_layers(model)  # fail early, with a clear message, on a dense or unsupported model
    return model, load_tokenizer(path) if tokenizer else None


def load_tokenizer(path):
    """The tokenizer of model folder `path`, or None when it has none that loads."""
    _, transformers = _import_hf()
    # transformers v5 builds an empty tokenizer for a folder without tokenizer files; look for them first.
    if not has_tokenizer_files(path):
        return None
    gguf = gguf_file(path)
    try:
        if gguf is not None:  # the tokenizer the file carries
            return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None

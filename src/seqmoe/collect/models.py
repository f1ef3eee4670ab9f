"""Load a transformers MoE causal LM (and its tokenizer) from a local folder or the name `seqmoe-tiny`.

    model, tokenizer = load_model("seqmoe-tiny")          # the packaged model
    model, tokenizer = load_model("models/olmoe-tiny")    # any folder with config.json
    layers = moe_layers(model)                            # its MoE layers and routers

Nothing is downloaded: folders load with `local_files_only=True`. torch and transformers are the
`hf` extra (`pip install seqmoe[hf]`).
"""

from __future__ import annotations

import os
from pathlib import Path

from seqmoe.arch import MoeLayer, moe_layers
from seqmoe.errors import UserError

__all__ = ["load_model", "moe_layers", "MoeLayer", "resolve_model_dir"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
    "tekken.json",
)


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """The local folder for `name_or_path`: `seqmoe-tiny` is the packaged model; else a folder with config.json."""
    from seqmoe import tiny

    if str(name_or_path) == tiny.NAME:
        return tiny.model_dir()
    path = Path(name_or_path)
    if not path.exists():
        raise UserError(
            f"no model at {path}: give a local model folder with config.json (nothing is downloaded) or {tiny.NAME}"
        )
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json; give the folder of a transformers model checkpoint")
    return path


def _import_hf():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise UserError(f"trace collection needs torch and transformers ({e}); install them: pip install 'seqmoe[hf]'") from None
    return torch, transformers


def load_model(
    name_or_path: str | os.PathLike, *, device: str | None = None, dtype: str = "auto", tokenizer: bool = True
):
    """(model in eval mode, tokenizer or None) for a local folder or `seqmoe-tiny`.

    Args:
        device: torch device ("cpu", "cuda", ...); None: cuda when available, else cpu.
        dtype: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".
        tokenizer: also load the folder's tokenizer; None when the folder has no tokenizer files.

    Raises:
        UserError: a missing folder or config, a checkpoint that does not load, a model without MoE layers.
    """
    torch, transformers = _import_hf()
    path = resolve_model_dir(name_or_path)
    if dtype not in _DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(_DTYPES)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
        )
    except (OSError, ValueError, KeyError) as e:
        msg = " ".join(str(e).split())[:300]
        raise UserError(f"cannot load a causal LM from {path}: {msg}") from None
    model.to(device).eval()
    moe_layers(model)  # fail early, with a clear message, on a dense or unsupported model
    tok = None
    # transformers v5 builds an empty tokenizer for a folder without tokenizer files; look for them first.
    if tokenizer and any((path / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError):
            tok = None
    return model, tok

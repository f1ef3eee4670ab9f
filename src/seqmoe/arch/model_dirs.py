"""Model folders: the models shipped inside the package by name, local checkpoints by path.
Nothing here imports torch, so a command can check its model argument before it loads anything.

    resolve_model_dir("seqmoe-tiny")     # the packaged folder
    resolve_model_dir("models/olmoe")    # any local folder with config.json
    has_tokenizer_files(path)            # whether the folder holds a tokenizer
    max_positions(path)                  # the context length its config.json gives, or None
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from seqmoe.arch.gguf_file import gguf_file, gguf_reader
from seqmoe.base.errors import UserError

TINY = "seqmoe-tiny"
MODEL_DIRS = {TINY: Path(__file__).resolve().parents[1] / "models" / TINY}
"""The packaged models' folders, by the name that resolves to them wherever a model path is accepted."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Weight dtypes a checkpoint loads in (auto: the checkpoint's)."""
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
    "tekken.json",
)


def packaged_model_dir(name: str) -> Path:
    """The folder of packaged model `name`; a UserError if its checkpoint is missing from this install."""
    path = MODEL_DIRS[name]
    if not (path / "config.json").is_file():
        raise UserError(f"{name} is not in this install ({path} has no config.json); "
                        "reinstall seqmoe or train it with `python -m seqmoe.arch.tiny.train`")
    return path


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """The local folder for `name_or_path`: a packaged model's name, else a folder with config.json, or a
    GGUF file (or a folder holding one)."""
    if str(name_or_path) in MODEL_DIRS:
        return packaged_model_dir(str(name_or_path))
    path = Path(name_or_path)
    if not path.exists():
        raise UserError(f"no model at {path}: give a local model folder with config.json (nothing is downloaded), "
                        f"a GGUF file, or one of the packaged models: {', '.join(MODEL_DIRS)}")
    if not (path / "config.json").is_file() and gguf_file(path) is None:
        raise UserError(f"{path} has no config.json; give the folder of a transformers model checkpoint, or a GGUF file")
    return path


def has_tokenizer_files(path: Path) -> bool:
    """The folder holds a tokenizer (transformers v5 builds an empty one for a folder without these files),
    or the GGUF file `path` names carries one."""
    gguf = gguf_file(path)
    if gguf is not None:
        return "tokenizer.ggml.model" in gguf_reader(gguf).fields
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def max_positions(path: Path) -> int | None:
    """The positions a model folder's config.json allows (`max_position_embeddings`, of its text config
    where it nests one); None where it does not say or `path` is a GGUF file (read when the model loads)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{config} is not a readable JSON file ({e}); give a folder saved by save_pretrained") from None
    data = data.get("text_config") or data if isinstance(data, dict) else {}
    n = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

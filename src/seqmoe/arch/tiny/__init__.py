"""seqmoe-tiny: a small MoE language model trained by this project and shipped inside the package.

`model_dir()` is where its checkpoint, tokenizer and model card live; the name `seqmoe-tiny`
resolves to it wherever a model path is accepted (`seqmoe.arch.model_dirs`). `train` trains it, `traces`
collects the embedded demo traces with it, `card` writes its model card.
"""

from __future__ import annotations

from pathlib import Path

from seqmoe.arch.model_dirs import MODEL_DIRS, TINY, packaged_model_dir

NAME = TINY
MODEL_DIR = MODEL_DIRS[TINY]


def model_dir() -> Path:
    """The packaged seqmoe-tiny folder; a UserError if the checkpoint is missing from this install."""
    return packaged_model_dir(NAME)

"""seqmoe-tiny: a small MoE language model trained by this project and shipped inside the package.

`model_dir()` is where its checkpoint, tokenizer and model card live; the name `seqmoe-tiny`
resolves to it wherever a model path is accepted.
"""

from __future__ import annotations

from pathlib import Path

from seqmoe.errors import UserError

NAME = "seqmoe-tiny"
MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / NAME


def model_dir() -> Path:
    """The packaged seqmoe-tiny folder; a UserError if the checkpoint is missing from this install."""
    if not (MODEL_DIR / "config.json").is_file():
        raise UserError(
            f"{NAME} is not in this install ({MODEL_DIR} has no config.json); "
            "reinstall seqmoe or train it with `python -m seqmoe.tiny.train`"
        )
    return MODEL_DIR

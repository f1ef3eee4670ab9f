"""Find or train the seq2seq forecaster a replay needs, and find the one a model learned online.

    predictor = seq_predictor_for(cfg.predictor, train)   # a checkpoint dir, or None: train (cached)
    weights, info = load_online(online_dir(key), config) or (None, {})

Without a checkpoint the forecaster is trained on the training trace once and kept under
`$SEQMOE_CACHE` (default `~/.cache/seqmoe`), keyed by a fingerprint of that trace. A forecaster
learned online (`seqmoe.predict.online`) is kept there too, keyed by the model's identity.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

from seqmoe.errors import UserError
from seqmoe.predict.seqmodel import PredictorError, SeqConfig, SeqPredictor, load_seq_predictor
from seqmoe.trace.schema import RoutingTrace


def trace_fingerprint(trace: RoutingTrace) -> str:
    """16 hex digits identifying a trace's routing, request boundaries and tokens."""
    h = hashlib.sha256()
    for a in (trace.expert_ids, trace.request_offsets, trace.token_ids):
        if a is not None:
            h.update(a.tobytes())
    h.update("\n".join(trace.vocab or ()).encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("SEQMOE_CACHE", Path.home() / ".cache" / "seqmoe"))


def seq_predictor_for(path: str | None, train: RoutingTrace, *, progress: bool = False) -> SeqPredictor:
    """Load the checkpoint at `path`, or the cached one trained on `train`, training it if absent."""
    if path is not None:
        return load_seq_predictor(path)
    out = cache_dir() / "predictors" / trace_fingerprint(train)
    if not (out / "model.safetensors").is_file():
        try:
            from seqmoe.predict.train import train_seq_predictor
        except ImportError:
            raise UserError("training a forecaster needs torch (pip install 'seqmoe[train]'); "
                            "or pass --predictor DIR") from None
        print(f"seqmoe: no --predictor given; training one on the training trace into {out} "
              "(once, up to 15 minutes)", file=sys.stderr)
        train_seq_predictor(train, out, progress=progress)
    return load_seq_predictor(out)


def online_dir(model_key: str) -> Path:
    """Where the online forecaster of the model identified by `model_key` is kept."""
    return cache_dir() / "online" / model_key


def load_online(folder: Path, config: SeqConfig) -> tuple[dict, dict] | None:
    """(weights, its `online` info: `tokens_learned`, `use_rate`) of the forecaster kept in `folder`, or
    None when there is none; one that is corrupt or of another shape is warned about and ignored (the
    next round overwrites it), never loaded."""
    if not folder.exists():
        return None
    try:
        pred = load_seq_predictor(folder)
        info = pred.info.get("online")
        if pred.config != config:
            raise PredictorError(f"it is of another shape ({pred.config.to_dict()}, this model's: {config.to_dict()})")
        LE = config.num_layers * config.num_experts
        if not isinstance(info, dict) or len(info.get("use_rate", ())) != LE or \
                not isinstance(info.get("tokens_learned"), int):
            raise PredictorError("its online record (tokens learned, use rates) is missing or malformed")
    except PredictorError as e:
        warnings.warn(f"seqmoe: ignoring the cached forecaster at {folder}: {e}; a new one is learned", stacklevel=2)
        return None
    return pred.w, info

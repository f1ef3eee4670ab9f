"""Find or train the seq2seq forecaster a replay needs.

    predictor = seq_predictor_for(cfg.predictor, train)   # a checkpoint dir, or None: train (cached)

Without a checkpoint the forecaster is trained on the training trace once and kept under
`$SEQMOE_CACHE` (default `~/.cache/seqmoe`), keyed by a fingerprint of that trace.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from seqmoe.errors import UserError
from seqmoe.predict.seqmodel import SeqPredictor, load_seq_predictor
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

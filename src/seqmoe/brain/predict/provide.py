"""A trained forecaster for a run: the checkpoint named, or the one cached for this training trace,
trained now if there is none (`$SEQMOE_CACHE/predictors/<fingerprint>`).

    predictor = seq_predictor_for(args.predictor, train)
"""

from __future__ import annotations

import sys

from seqmoe.base.errors import needs_extra
from seqmoe.brain.predict.checkpoints import cache_dir, load_seq_predictor, save_checkpoint, trace_fingerprint
from seqmoe.brain.predict.seqmodel import SeqPredictor
from seqmoe.trace.schema import RoutingTrace


def seq_predictor_for(path: str | None, train: RoutingTrace, *, progress: bool = False) -> SeqPredictor:
    """Load the checkpoint at `path`, or the cached one trained on `train`, training it if absent."""
    if path is not None:
        return load_seq_predictor(path)
    out = cache_dir() / "predictors" / trace_fingerprint(train)
    if not (out / "model.safetensors").is_file():
        try:
            from seqmoe.brain.predict.train import train_seq_predictor  # torch: only when this runs
        except ImportError:
            raise needs_extra("training a forecaster needs torch (or pass --predictor DIR)", "train") from None
        print(f"seqmoe: no --predictor given; training one on the training trace into {out} "
              "(once; about 10 minutes on 2 cores for DeepSeek-V2-Lite's Puffin trace)", file=sys.stderr)
        train_seq_predictor(train, out, progress=progress)
    pred = load_seq_predictor(out)
    if not pred.config.far_head:  # cached before the long-range head existed: fit it once
        try:
            from seqmoe.brain.predict.train import with_far_head  # torch: only when this runs
        except ImportError:  # no torch: the forecaster as it is
            return pred
        print(f"seqmoe: fitting the long-range head of the cached forecaster in {out} (once)", file=sys.stderr)
        save_checkpoint(out, *with_far_head(pred.config, pred.w, train), pred.info)
        pred = load_seq_predictor(out)
    return pred

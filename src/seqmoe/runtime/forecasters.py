"""The forecaster of a `seqmoe*` system in the runtime: the one given (`given_forecaster`), or one
learned online (`online_forecaster_for`), starting from what the model learned before and kept per
model (`model_key`) under `$SEQMOE_CACHE`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.brain.predict.checkpoints import load_online, load_seq_predictor, online_dir
from seqmoe.brain.predict.online import OnlineForecaster, cold_prior, online_config
from seqmoe.trace.schema import check_dims, placeholder_trace


def given_forecaster(predictor, L: int, E: int, K: int):
    """The forecaster of a `seqmoe*` system: `predictor` (a checkpoint folder or a `SeqPredictor`), checked
    against L/E/K. `offload` trains none (the commands do: `seqmoe.runtime.load`)."""
    if predictor is None:
        raise UserError("the seqmoe systems need the seq2seq forecaster: pass predictor= (a checkpoint folder of "
                        "`seqmoe train`; `seqmoe.brain.predict.provide.seq_predictor_for(None, train)` trains one on a "
                        "trace and caches it)")
    if isinstance(predictor, (str, os.PathLike)):
        predictor = load_seq_predictor(predictor)
    if getattr(predictor, "config", None) is not None:
        check_dims("the predictor's training trace", predictor.config, placeholder_trace(L, E, K, "model"),
                   "train one on a trace of this model (seqmoe train)")
    if not all(callable(getattr(predictor, m, None)) for m in ("check_trace", "begin_request", "begin_token",
                                                                 "observe", "predict")):
        raise UserError(f"predictor= must be a checkpoint folder or a SeqPredictor, got {type(predictor).__name__}")
    return predictor


def online_forecaster_for(model, originals, L: int, E: int, K: int, first=None) -> tuple[OnlineForecaster, tuple, Path]:
    """The forecaster a `seqmoe*` system learns online when given none: from the one this model learned
    before (`$SEQMOE_CACHE`) when there is one, else new; the prior it starts from (`cold_prior`, with the
    cached use rates); its folder."""
    config = online_config(L, E, K)
    folder = online_dir(model_key(model, originals, first))
    cached = load_online(folder, config)
    if cached is None:
        return OnlineForecaster(config, None), cold_prior(L, E, K), folder
    weights, info = cached
    fc = OnlineForecaster(config, None, weights=weights, tokens_learned=info["tokens_learned"], source="cache")
    return fc, cold_prior(L, E, K, np.asarray(info["use_rate"], dtype=np.float64)), folder


def model_key(model, originals, first=None) -> str:
    """16 hex digits identifying a model: its config (names and paths left out) and a sample of the
    first expert's weights of every MoE layer (`first(l)`: {name: expert 0's slice} of MoE layer l,
    for experts still on disk; default: read from the parameters)."""
    conf = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    h = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode())
    for l, x in enumerate(originals):
        given = None if first is None else first(l)
        for name, p in x.named_parameters():
            w = p.detach()[0] if given is None else given[name]
            h.update(w.reshape(-1)[::97][:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]

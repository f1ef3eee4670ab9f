"""Save and load the seq2seq forecaster, and find the one a model learned online.

    save_checkpoint(out, config, weights, info); load_seq_predictor(out)
    weights, info = load_online(online_dir(key), config) or (None, {})

Forecasters trained for a replay (`provide.seq_predictor_for`) are kept under `$SEQMOE_CACHE`
(default `~/.cache/seqmoe`), keyed by a fingerprint of their training trace. A forecaster learned
online (`seqmoe.brain.predict.online`) is kept there too, keyed by the model's identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from seqmoe.base.files import atomic_path
from seqmoe.brain.predict.seqmodel import PredictorError, SeqConfig, SeqPredictor
from seqmoe.trace.schema import RoutingTrace

FORMAT = "seqmoe-seq-predictor"
VERSION = "1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def save_checkpoint(out_dir: str | os.PathLike, config: SeqConfig, weights: dict[str, np.ndarray],
                    info: dict) -> None:
    """Write `model.safetensors` (float32 weights) and `config.json` (config + info) into `out_dir`."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
    with atomic_path(out / WEIGHTS_FILE) as tmp:
        save_file(tensors, tmp, metadata={"format": FORMAT, "version": VERSION})
    doc = {"format": FORMAT, "version": VERSION, "config": config.to_dict(), **info}
    with atomic_path(out / CONFIG_FILE) as tmp:
        Path(tmp).write_text(json.dumps(doc, indent=2) + "\n")


def load_seq_predictor(path: str | os.PathLike, *, window: int | None = None) -> SeqPredictor:
    """Load a checkpoint folder written by `train_seq_predictor`; PredictorError if missing or corrupt.

    `window`: see `SeqPredictor` (None: the reference inference)."""
    d = Path(path)
    hint = "train one with `seqmoe train --trace TRAIN --out DIR`"
    if not d.is_dir():
        raise PredictorError(f"no predictor folder at {d}; {hint}")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (d / name).is_file():
            raise PredictorError(f"{d} lacks {name}: not a predictor checkpoint; {hint}")
    try:
        doc = json.loads((d / CONFIG_FILE).read_text())
        if doc.get("format") != FORMAT:
            raise PredictorError(f"{d / CONFIG_FILE}: format {doc.get('format')!r}, expected {FORMAT!r}")
        if doc.get("version") != VERSION:
            raise PredictorError(f"{d / CONFIG_FILE}: version {doc.get('version')!r}; this seqmoe reads {VERSION}")
        config = SeqConfig.from_dict(doc["config"])
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise PredictorError(f"{d / CONFIG_FILE}: unreadable predictor config ({e})") from None
    try:
        with safe_open(d / WEIGHTS_FILE, framework="numpy") as f:
            weights = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise PredictorError(f"{d / WEIGHTS_FILE}: unreadable weights ({e})") from None
    want = config.weight_shapes()
    bad = [f"{k}: {weights[k].shape if k in weights else 'missing'} != {s}" for k, s in want.items()
           if k not in weights or tuple(weights[k].shape) != s]
    if bad:
        raise PredictorError(f"{d / WEIGHTS_FILE} does not match {CONFIG_FILE}: {'; '.join(bad[:3])}")
    return SeqPredictor(config, weights, {k: v for k, v in doc.items() if k not in ("format", "version", "config")},
                        window=window)


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


def online_dir(model_key: str) -> Path:
    """Where the online forecaster of the model identified by `model_key` is kept."""
    return cache_dir() / "online" / model_key


MAX_WEIGHT = 1e4
"""Largest |weight| a cached online forecaster may hold: a trained one stays far below (a corrupt file does not)."""


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
        learned = info.get("tokens_learned") if isinstance(info, dict) else None
        if not isinstance(learned, int) or isinstance(learned, bool) or learned < 0:
            raise PredictorError(f"its tokens learned ({learned!r}) is not a count")
        try:
            rate = np.asarray(info.get("use_rate"), dtype=np.float64)
        except (TypeError, ValueError):
            rate = None
        if rate is None or rate.shape != (LE,) or not (np.isfinite(rate).all() and (rate >= 0).all() and (rate <= 1).all()):
            raise PredictorError(f"its use rates are not {LE} shares in [0, 1]")
        for name, w in pred.w.items():  # random bytes or a bad update: the forecast would be NaN, or divide by 0
            if not np.isfinite(w).all() or np.abs(w).max(initial=0.0) > MAX_WEIGHT:
                raise PredictorError(f"its weight {name} holds non-finite or absurd values (beyond {MAX_WEIGHT:g})")
        info = {**info, "use_rate": rate.tolist()}
    except (PredictorError, ValueError, TypeError, KeyError, AttributeError) as e:  # whatever a damaged file gives
        warnings.warn(f"seqmoe: ignoring the cached forecaster at {folder}: {e}; a new one is learned", stacklevel=2)
        return None
    return pred.w, info

"""Warm up a model's online forecaster before it serves: `seqmoe calibrate`.

    info = calibrate(model, tokenizer, texts)          # texts: the user's, or `default_texts()`

The model's routing over `texts` (one prompt forward per text, `seqmoe.arch.collect.collect_trace`) is
learned round by round exactly as a run would learn it (`OnlineTrainer`, one pass per snapshot of
`OnlineSchedule.buffer` tokens), starting from what the model already learned when its cache holds
it, and the result is saved where `offload` looks for it (`predict.checkpoints.online_dir`).
The default text is this Python's own standard library source (PSF License 2.0, on every machine
with Python; `seqmoe.arch.tiny.corpus`): a corpus of code, so the user's own text serves better.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from seqmoe.arch import model_arch
from seqmoe.arch.collect import collect_trace
from seqmoe.arch.tiny.corpus import stdlib_corpus
from seqmoe.base.errors import UserError
from seqmoe.brain.predict.buckets import trace_buckets
from seqmoe.brain.predict.checkpoints import load_online, online_dir, save_checkpoint
from seqmoe.brain.predict.online import OnlineSchedule, fit_prior, online_config
from seqmoe.brain.predict.train import OnlineTrainer
from seqmoe.config import CALIBRATION_TOKENS
from seqmoe.runtime.forecasters import model_key

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".c", ".js", ".html")
"""Files `texts_from` reads from a folder."""


def texts_from(folder: str | os.PathLike) -> list[str]:
    """The text files under `folder` (by `TEXT_SUFFIXES`, sorted by path); UserError when there are none."""
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"no text folder at {root}; give a folder of .txt / .md / .py files")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    texts = [t for t in (p.read_bytes().decode("utf-8", errors="replace") for p in files) if t.strip()]
    if not texts:
        raise UserError(f"{root} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return texts


def default_texts() -> list[str]:
    """This interpreter's standard library source, training part (`seqmoe.arch.tiny.corpus`, PSF-2.0)."""
    return stdlib_corpus().train_texts()


def calibrate(model, tokenizer, texts: list[str], *, max_tokens: int = CALIBRATION_TOKENS, chunk: int = 512,
              progress: bool = True) -> dict:
    """Learn `model`'s online forecaster from its routing over `texts` (at most `max_tokens` tokens, in
    requests of `chunk` tokens) and save it where `offload` finds it. Returns a summary."""
    if max_tokens < 1 or chunk < 1:
        raise UserError(f"calibration needs a positive number of tokens and chunk size, got {max_tokens} and {chunk}")
    chunk = min(chunk, getattr(model.config, "max_position_embeddings", None) or chunk)
    requests = []
    for text in texts:
        ids = tokenizer(text, verbose=False)["input_ids"]  # long texts are cut into requests below
        for i in range(0, len(ids), chunk):
            requests.append(ids[i:i + chunk])
            max_tokens -= len(requests[-1])
            if max_tokens <= 0:
                break
        if max_tokens <= 0:
            break
    if not requests:
        raise UserError("the calibration text has no tokens")
    trace = collect_trace(model, requests, progress=progress, source="seqmoe calibrate")
    arch = model_arch(model)
    cfg = online_config(trace.num_layers, trace.num_experts, trace.top_k)
    folder = online_dir(model_key(model, [m.experts for m in arch.moe]))
    cached = load_online(folder, cfg)
    weights, learned = (None, 0) if cached is None else (cached[0], cached[1]["tokens_learned"])
    trainer = OnlineTrainer(cfg, weights=weights)
    buckets = trace_buckets(trace, cfg.hash_buckets)  # the token ids hashed, as the live forecaster hashes them
    starts = np.zeros(trace.num_tokens, dtype=bool)
    starts[trace.request_offsets[:-1]] = True
    size = OnlineSchedule().buffer
    for a in tqdm(range(0, trace.num_tokens, size), disable=not progress, desc="calibrate", unit="round"):
        w = trainer.round(trace.expert_ids[a:a + size], buckets[a:a + size], starts[a:a + size])
    use_rate, _ = fit_prior(trace.expert_ids, starts, trace.num_experts)
    learned += trace.num_tokens
    save_checkpoint(folder, cfg, w, {"online": {"tokens_learned": learned, "use_rate": use_rate.tolist()}})
    return {"folder": str(folder), "tokens": trace.num_tokens, "requests": trace.num_requests,
            "tokens_learned": learned, "from_cache": cached is not None}

"""The embedded default workload: routing traces of seqmoe-tiny over Python standard library source.

    python -m seqmoe.arch.tiny.traces            # rewrites src/seqmoe/data/seqmoe-tiny-{train,test}.safetensors
    train, test = load_demo_traces()

A request is one window of `REQUEST_TOKENS` tokens (the model's context) of a stdlib file, the
first `CHUNKS` windows of each file, run through the packaged model by `seqmoe.arch.collect` (prompt
mode; batch-1 decode routes the same tokens the same way). The train part reads files the model
trained on (every `TRAIN_EVERY`-th, in sorted order); the test part reads the files held out from
its training (`corpus.is_heldout`), so predictors and policies are measured on text neither the
model nor they have seen. Only expert ids and token ids are kept
(gate weights would triple the size). The files are made by this project and ship with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np

from seqmoe.arch.tiny import MODEL_DIR, NAME
from seqmoe.arch.tiny.card import ROUTING_HEADING
from seqmoe.arch.tiny.corpus import stdlib_corpus
from seqmoe.trace.io import load_trace, save_trace
from seqmoe.trace.schema import RoutingTrace
from seqmoe.trace.stats import summarize

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
TRAIN_FILE, TEST_FILE = DATA_DIR / "seqmoe-tiny-train.safetensors", DATA_DIR / "seqmoe-tiny-test.safetensors"
REQUEST_TOKENS = 256
"""Tokens per request: the model's context."""
CHUNKS = {"train": 1, "test": 4}
"""Requests (consecutive windows) per file, by part (the train part stays under 2 MB)."""
TRAIN_EVERY = 4
"""The train part takes every 4th training file."""


def load_demo_traces() -> tuple[RoutingTrace, RoutingTrace]:
    """(train, test) traces of seqmoe-tiny shipped in `seqmoe/data/`."""
    return load_trace(TRAIN_FILE), load_trace(TEST_FILE)


def collect_demo_traces(out_dir: Path = DATA_DIR, *, progress: bool = True) -> tuple[RoutingTrace, RoutingTrace]:
    """Collect both parts with the packaged model and write them into `out_dir`."""
    import torch  # torch: only when this runs

    from seqmoe.arch.collect import collect_trace, load_model  # torch: only when this runs

    torch.manual_seed(0)
    model, tok = load_model(NAME, device="cpu", dtype="float32")
    corpus = stdlib_corpus()
    parts = {"train": corpus.train_files[::TRAIN_EVERY], "test": corpus.heldout_files}
    out = []
    for part, files in parts.items():
        requests, labels = [], []
        for f in files:
            ids = tok(corpus.read(f))["input_ids"]
            for c in range(min(CHUNKS[part], -(-len(ids) // REQUEST_TOKENS))):
                requests.append(ids[c * REQUEST_TOKENS:(c + 1) * REQUEST_TOKENS])
                labels.append(f"{f}#{c}")
        trace = collect_trace(model, requests, max_tokens=REQUEST_TOKENS, labels=labels, model_name=NAME,
                              source=f"seqmoe.arch.tiny.traces ({part}: stdlib files)", progress=progress)
        trace = dataclasses.replace(trace, gate_weights=None)
        save_trace(trace, out_dir / f"seqmoe-tiny-{part}.safetensors")
        out.append(trace)
    return out[0], out[1]


def routing_table(traces: dict[str, RoutingTrace]) -> str:
    """Markdown: popularity skew, token-to-token reuse and inter-layer affinity of each trace."""
    lines = ["| routing of | L / E / K | tokens | token reuse (random K/E) | top-10 % experts' share of "
             "activations (uniform) | layer affinity (popular-experts guess) |", "|---" * 6 + "|"]
    for name, t in traces.items():
        s = summarize(t)
        lines.append(
            f"| {name} | {t.num_layers} / {t.num_experts} / {t.top_k} | {t.num_tokens:,} | "
            f"{s['token_reuse']:.3f} ({s['token_reuse_random']:.3f}) | "
            f"{np.mean(s['skew_top_share']):.3f} ({s['skew_top_share_uniform']:.3f}) | "
            f"{s['layer_affinity']:.3f} ({s['layer_affinity_popular']:.3f}) |")
    return "\n".join(lines)


def fill_card(shared: Path, card: Path | None = None) -> str:
    """Write the routing statistics of the shipped test trace, next to the shared real traces', into the card."""
    card = card or MODEL_DIR / "README.md"
    traces = {"seqmoe-tiny (held-out stdlib files, `seqmoe-tiny-test`)": load_trace(TEST_FILE)}
    real = {"DeepSeek-V2-Lite (Puffin prompts, shared MoE-Beyond trace)": "deepseek-v2-lite-puffin/puffin",
            "Mixtral-8x7B (shared speculative-MoE trace)": "mixtral8x7b-speculative-moe"}
    for name, rel in real.items():
        if (shared / "data/traces" / rel).exists():
            traces[name] = load_trace(shared / "data/traces" / rel)
    section = (f"{ROUTING_HEADING}\n\nMeasured with `seqmoe.trace.stats` (`python -m seqmoe.arch.tiny.traces --card-only`); "
               "the real models' numbers come from the routing traces in the project's shared data (statistics "
               "only; the traces are not redistributed). Token reuse: share of a token's experts at a layer that "
               "the previous token also used there. Layer affinity: share of a token's experts at layer l+1 "
               "that a successor table (co-use counts of layer l's experts with layer l+1's, in-sample) ranks in "
               "its top K, against always guessing layer l+1's K most used experts.\n\n"
               + routing_table(traces) + "\n")
    text = card.read_text()
    cut = text.index(ROUTING_HEADING)
    card.write_text(text[:cut] + section)
    return section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Collect seqmoe-tiny's routing over stdlib source (the demo workload) "
                                "and write its routing statistics into the model card.")
    p.add_argument("--out", type=Path, default=DATA_DIR, help=f"folder for the two trace files (default: {DATA_DIR})")
    p.add_argument("--shared", type=Path, default=Path(os.environ.get("SEQMOE_SHARED", "../shared")),
                   help="shared folder with the real traces to compare against (default: ../shared)")
    p.add_argument("--card-only", action="store_true", help="only recompute the card's routing statistics")
    args = p.parse_args(argv)
    if not args.card_only:
        train, test = collect_demo_traces(args.out)
        print(f"train: {train.num_tokens} tokens, {train.num_requests} requests; "
              f"test: {test.num_tokens} tokens, {test.num_requests} requests -> {args.out}", file=sys.stderr)
    print(fill_card(args.shared))
    return 0


if __name__ == "__main__":
    sys.exit(main())

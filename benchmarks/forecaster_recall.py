"""The forecaster's recall, trained afresh and checked against the figures recorded here: a guard.

    python benchmarks/forecaster_recall.py [--quick] [--out results/forecaster_recall.json]

Trains the sequence forecaster with `seqmoe train`'s defaults (seed 0, no time limit) on one torch
thread, so the same code gives the same weights on any machine of the same torch build, then scores
it with `eval-predictor`'s recall@K on prompts it never saw: DeepSeek-V2-Lite's WebGLM routing of
../shared, trained on all of Puffin (about 10 minutes on one core; --quick: Puffin's first 300
prompts, 2 epochs, about 2 minutes). Prints recall@K one layer, one token and two tokens ahead beside
the figures recorded below and exits 1 when any fell by more than TOLERANCE: a change to training
or inference that costs recall shows here, not months later in a hit rate. A deliberate change
records its new figures here with the reason in docs/LOG.md. Skipped with a note when ../shared is
absent.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from puffin_split import add_shared_flag
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.brain.predict.evaluate import evaluate_predictor
from seqmoe.brain.predict.train import train_seq_predictor
from seqmoe.trace.io import load_trace

RECORDED = {"full": {"one layer": 0.6864, "one token": 0.4411, "two tokens": 0.3021},
            "quick": {"one layer": 0.5618, "one token": 0.3590, "two tokens": 0.2506}}
"""recall@K by distance name, as this script printed them (docs/LOG.md, 2026-12-06)."""
TOLERANCE = 0.005
QUICK = {"prompts": 300, "epochs": 2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--quick", action="store_true", help="Puffin's first 300 prompts, 2 epochs (about 2 minutes)")
    p.add_argument("--out", default="results/forecaster_recall.json", help="JSON of the figures")
    args = p.parse_args(argv)
    root = Path(args.shared) / "data/traces"
    train_dir, test_dir = root / "deepseek-v2-lite-puffin/puffin", root / "deepseek-v2-lite-webglm-moe-beyond/routing"
    if not train_dir.is_dir() or not test_dir.is_dir():
        print(f"shared traces not found under {root}; skipped", file=sys.stderr)
        return 0
    mode = "quick" if args.quick else "full"
    train, test = load_trace(train_dir), load_trace(test_dir)
    quick = {}  # full: `seqmoe train`'s own defaults
    if args.quick:
        train, quick = train.select_requests(np.arange(QUICK["prompts"])), {"epochs": QUICK["epochs"]}
    with tempfile.TemporaryDirectory() as tmp:
        info = train_seq_predictor(train, tmp, seed=0, threads=1, progress=True, **quick)
        seq = load_seq_predictor(tmp)
    seq.check_trace(test)
    L = test.num_layers
    names = {1: "one layer", L: "one token", 2 * L: "two tokens"}
    got = evaluate_predictor(test, seq, horizons=tuple(names), progress=True)["recall_at_k"]
    figures = {names[h]: round(float(got[h]), 4) for h in names}
    fell = []
    print(f"forecaster recall@K on WebGLM ({mode}: {info['training']['num_train_requests']} Puffin prompts, "
          f"{info['training']['epochs_run']} epochs, {info['training']['seconds']:.0f} s)")
    for name, value in figures.items():
        was = RECORDED[mode].get(name)
        note = "" if was is None else f"   recorded {was:.4f}" + ("   FELL" if value < was - TOLERANCE else "")
        if was is not None and value < was - TOLERANCE:
            fell.append(name)
        print(f"  {name + ' ahead':<18} {value:.4f}{note}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"mode": mode, "recall_at_k": figures, "recorded": RECORDED[mode],
                                          "training": info["training"]}, indent=1, default=str))
    if fell:
        print(f"recall fell by more than {TOLERANCE} at: {', '.join(fell)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Recall@K against distance for pre-gating alone, routing history alone and their fusion, on
seqmoe-tiny text it never saw, with a*exp(-b*t)+c fitted to each curve.

    python benchmarks/hybrid_predict.py --predictor DIR --tokens 4000 --plot docs/img/hybrid_recall.png

The shipped seqmoe-tiny traces hold no pre-gate scores, so their requests (the same token ids) are
collected again with `pregate = L - 1` (cached under --cache). The history forecaster is the
seq2seq one (`--predictor`, trained on seqmoe-tiny's training routing); the fusion's weights per
distance are fitted on the training routing (`seqmoe.brain.predict.pregate.fit_alphas`), then every
predictor is scored on the held-out routing (`seqmoe.brain.predict.evaluate`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import numpy as np


def _with_pregate(trace, path: str):
    """`trace` collected again from seqmoe-tiny with pre-gate scores (cached at `path`)."""
    from seqmoe.trace.io import load_trace, save_trace

    if os.path.exists(path):
        return load_trace(path)
    from seqmoe.arch.collect import collect_trace, load_model

    model, _ = load_model("seqmoe-tiny", device="cpu", dtype="float32")
    off = trace.request_offsets
    requests = [trace.token_ids[a:b].tolist() for a, b in zip(off[:-1], off[1:])]
    out = collect_trace(model, requests, pregate=trace.num_layers - 1, model_name="seqmoe-tiny",
                        source="benchmarks/hybrid_predict.py", progress=True)
    if not np.array_equal(out.expert_ids, trace.expert_ids):
        raise SystemExit("the recollected routing differs from the shipped trace; is this the shipped model?")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_trace(out, path)
    return out


def fit_decay(t: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(a, b, c) of a*exp(-b*t)+c by least squares: a grid over b, a and c linear for each."""
    best = None
    for b in np.logspace(-3, 1, 400):
        X = np.stack([np.exp(-b * t), np.ones_like(t)], axis=1)
        (a, c), *_ = np.linalg.lstsq(X, y, rcond=None)
        err = float(((X @ np.array([a, c]) - y) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, float(a), float(b), float(c))
    return best[1:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictor", required=True, help="seq2seq forecaster of seqmoe-tiny (seqmoe train on its training routing)")
    p.add_argument("--tokens", type=int, default=4000, help="held-out tokens scored (whole requests)")
    p.add_argument("--fit-tokens", type=int, default=3000, help="training tokens the fusion weights are fitted on")
    p.add_argument("--cache", default="results/pregate", help="where the recollected traces are kept")
    p.add_argument("--plot", help="write the recall curves here (.png)")
    p.add_argument("--out", help="JSON file of the curves")
    args = p.parse_args(argv)

    import torch

    from seqmoe.brain.predict.evaluate import evaluate_predictors
    from seqmoe.brain.predict.pregate import HybridPredictor, PregatePredictor, fit_alphas
    from seqmoe.brain.predict.checkpoints import load_seq_predictor
    from seqmoe.arch.tiny.traces import load_demo_traces

    torch.set_num_threads(1)
    train, test = load_demo_traces()
    train = _with_pregate(train, os.path.join(args.cache, "train.safetensors"))
    test = _with_pregate(test, os.path.join(args.cache, "test.safetensors")).head(args.tokens)
    L = test.num_layers
    history = load_seq_predictor(args.predictor)
    history.check_trace(train)
    alphas = fit_alphas(copy.deepcopy(history), train, max_tokens=args.fit_tokens)
    print("fusion weight of history per distance:", " ".join(f"{a:.1f}" for a in alphas), file=sys.stderr)
    history.check_trace(test)
    predictors = {"pre-gate": PregatePredictor(test), "history": copy.deepcopy(history),
                  "hybrid": HybridPredictor(copy.deepcopy(history), test, alphas)}
    horizons = tuple(range(1, 2 * L + 1))
    results = evaluate_predictors(test, predictors, horizons=horizons, progress=True)
    curves = {}
    for name, res in results["predictors"].items():
        y = np.array([res["recall_at_k"][h] for h in horizons])
        curves[name] = {"recall_at_k": y.tolist(), "fit": dict(zip("abc", fit_decay(np.array(horizons, float), y)))}
    print(f"{'distance':>8} " + " ".join(f"{n:>9}" for n in curves))
    for i, h in enumerate(horizons):
        print(f"{h:>8} " + " ".join(f"{c['recall_at_k'][i]:>9.3f}" for c in curves.values()))
    for n, c in curves.items():
        print(f"{n}: recall@K ~ {c['fit']['a']:.3f} exp(-{c['fit']['b']:.3f} t) + {c['fit']['c']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"horizons": horizons, "alphas": alphas.tolist(), "curves": curves,
                       "test_tokens": test.num_tokens}, f, indent=1)
    if args.plot:
        _plot(horizons, curves, args.plot, L)
    return 0


def _plot(horizons, curves, path: str, L: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.array(horizons, float)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        line, = ax.plot(t, c["recall_at_k"], "o", ms=3, label=name)
        f = c["fit"]
        ax.plot(t, f["a"] * np.exp(-f["b"] * t) + f["c"], "-", color=line.get_color(), lw=1,
                label=f"{f['a']:.2f} exp(-{f['b']:.2f} t) + {f['c']:.2f}")
    ax.axvline(L - 0.5, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("distance (positions ahead; a token is %d)" % L)
    ax.set_ylabel("recall@K")
    ax.set_title("seqmoe-tiny held-out text: pre-gate, history, hybrid", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

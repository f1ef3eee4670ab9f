"""What each expert precision costs in quality, on seqmoe-tiny's held-out text.

    python benchmarks/precision_quality.py [--requests 60] [--out results/precision_quality.json]

The held-out requests of the embedded test trace (256-token windows of stdlib files the model never
trained on) are scored teacher-forced, one batched forward per 8 requests, by the full model at its
own dtype and by the same model with its experts quantized (`seqmoe.quantize_experts`: the weights an
offloaded model with that `expert_dtype` computes with, exactly). Per precision: perplexity and its
change, greedy agreement (the argmax equals the full model's at the same position) and the mean
KL divergence from the full model's next-token distribution, nats per position. Prints a table, then
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

PRECISIONS = ("int8", "fp8", "int4")


def _score(model, x, reference=None):
    """(summed NLL, positions, argmax [N], log-probs list per batch, summed KL against `reference`)."""
    import torch

    nll, n, argmax, logps, kl = 0.0, 0, [], [], 0.0
    with torch.no_grad():
        for i in range(0, len(x), 8):
            ids = x[i:i + 8]
            logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].double(), -1)
            nll -= float(logp.gather(-1, ids[:, 1:, None]).sum())
            n += ids[:, 1:].numel()
            argmax.append(logp.argmax(-1).reshape(-1))
            logps.append(logp)
            if reference is not None:
                ref = reference[len(logps) - 1]
                kl += float((ref.exp() * (ref - logp)).sum())
    return nll, n, torch.cat(argmax), logps, kl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=60, help="held-out requests of 256 tokens scored")
    p.add_argument("--out", help="also write the rows to this JSON file")
    args = p.parse_args()

    import numpy as np
    import torch

    import seqmoe
    from seqmoe.arch.collect import load_model
    from seqmoe.arch.tiny.traces import load_demo_traces

    torch.set_num_threads(max(1, torch.get_num_threads()))
    _, test = load_demo_traces()
    off = test.request_offsets
    windows = [test.token_ids[a:b] for a, b in zip(off[:-1].tolist(), off[1:].tolist()) if b - a == 256]
    x = torch.tensor(np.stack(windows[:args.requests]).astype(np.int64))
    model, _ = load_model("seqmoe-tiny", device="cpu")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    nll, n, argmax, logps, _ = _score(model, x)
    full = math.exp(nll / n)
    rows = [{"precision": dtype, "perplexity": full, "perplexity_change": 0.0, "agreement": 1.0, "mean_kl": 0.0,
             "positions": n}]
    for precision in PRECISIONS:
        q, _ = load_model("seqmoe-tiny", device="cpu")
        seqmoe.quantize_experts(q, precision)
        qnll, _, qargmax, _, kl = _score(q, x, logps)
        ppl = math.exp(qnll / n)
        rows.append({"precision": precision, "perplexity": ppl, "perplexity_change": ppl / full - 1,
                     "agreement": float((qargmax == argmax).double().mean()), "mean_kl": kl / n, "positions": n})
    print(f"seqmoe-tiny, {n} held-out positions ({len(x)} requests), experts quantized; the rest at {dtype}\n")
    print("| experts | perplexity | change | greedy agreement | mean KL (nats) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['perplexity']:.3f} | {100 * r['perplexity_change']:+.2f} % | "
              f"{r['agreement']:.4f} | {r['mean_kl']:.5f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The twin miss path on seqmoe-tiny: time and copies saved against quality, for several budgets.

    python benchmarks/twin_quality.py --tokens 2000 --budgets 0,0.1,0.25,0.5,1,2 --plot docs/img/twin_quality.png

Held-out text (the token ids of seqmoe-tiny's held-out routing trace) is decoded teacher-forced,
one token per forward, at full load and offloaded with `twin=` at each budget (gate weight per
token). Reported per (twin precision, budget): miss rate, misses served by twins, copies and
simulated decode time (the runtime's virtual clock, default hardware profile) and their change
against budget 0 (the same system, residency and miss path with no twin read), perplexity and its
change against full load, greedy-token agreement with the full model, and the mean KL divergence
of the offloaded model's next-token distribution from the full model's (nats per position).
Budget 0 runs the twin path's code with nothing to spend.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from cache_routing import decode, full_load_reference


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="held-out tokens decoded (whole requests)")
    p.add_argument("--budgets", default="0,0.1,0.25,0.5,1,2", help="twin budgets, gate weight per token")
    p.add_argument("--twins", default="int4,int8", help="twin precisions")
    p.add_argument("--residency", type=float, default=0.25)
    p.add_argument("--system", default="on-demand-lru")
    p.add_argument("--miss", default="copy", help="the miss path of the misses no twin serves")
    p.add_argument("--plot", help="write the time-against-KL curves here (.png)")
    p.add_argument("--out", help="JSON file of the rows")
    args = p.parse_args(argv)

    import torch

    from seqmoe.config import DEFAULT_HARDWARE
    from seqmoe.runtime import offload

    torch.set_num_threads(1)
    train, model, requests, (full_argmax, full_nll, full_logp) = full_load_reference(args.tokens)
    n = len(full_argmax)
    full_ppl = math.exp(full_nll / n)
    rows = []
    for twin in args.twins.split(","):
        base = None
        for budget in (float(b) for b in args.budgets.split(",")):
            rt = offload(model, args.residency, args.system, train=train, miss=args.miss, twin=twin,
                         twin_budget=budget, hardware=DEFAULT_HARDWARE)
            try:
                argmax, nll, logp = decode(model, requests)
                s = rt.stats()
            finally:
                rt.restore()
            base = base or s
            ppl = math.exp(nll / n)
            kl = float((full_logp.exp() * (full_logp - logp)).sum(-1).mean())
            rows.append({"twin": twin, "twin_budget": budget, "system": args.system, "residency": args.residency,
                         "miss": args.miss, "miss_rate": s["miss_rate"], "misses": s["misses"],
                         "misses_twin": s["misses_twin"], "twin_weight_per_token": s["twin_weight_per_token"],
                         "copies": s["sim_copies"], "copies_change": s["sim_copies"] / base["sim_copies"] - 1,
                         "sim_time_s": s["sim_time_s"], "time_change": s["sim_time_s"] / base["sim_time_s"] - 1,
                         "perplexity": ppl, "perplexity_change": ppl / full_ppl - 1,
                         "agreement": sum(a == b for a, b in zip(argmax, full_argmax)) / n, "mean_kl": kl,
                         "positions": n})
            r = rows[-1]
            print(f"{twin} budget {budget:<5g} misses {r['misses']:6d} twin {r['misses_twin']:6d} copies "
                  f"{r['copies_change']:+6.1%} time {r['time_change']:+6.1%} perplexity {ppl:.3f} "
                  f"({r['perplexity_change']:+.2%}) agreement {r['agreement']:.4f} mean KL {kl:.5f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"full_perplexity": full_ppl, "rows": rows}, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for twin in dict.fromkeys(r["twin"] for r in rows):
        mine = [r for r in rows if r["twin"] == twin]
        x = [r["mean_kl"] for r in mine]
        y = [-100 * r["time_change"] for r in mine]
        ax.plot(x, y, "o-", label=f"{twin} twin")
        for r, xi, yi in zip(mine, x, y):
            ax.annotate(f"{r['twin_budget']:g}", (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set_xlabel("mean KL from the full model's next-token distribution (nats)")
    ax.set_ylabel("decode time saved against no twin (%)")
    ax.set_title(f"twin miss path, seqmoe-tiny, {rows[0]['system']} r={rows[0]['residency']:g} miss={rows[0]['miss']} "
                 "(labels: budget)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

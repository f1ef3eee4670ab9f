"""Cache-aware routing on seqmoe-tiny: misses saved against quality, for several KL budgets.

    python benchmarks/cache_routing.py --tokens 2000 --budgets 0,0.002,0.005,0.01,0.02,0.05 --plot docs/img/cache_routing.png

Held-out text (the token ids of seqmoe-tiny's held-out routing trace: stdlib files the model never
trained on) is decoded teacher-forced, one token per forward, at full load and offloaded with
`routing="cache-aware"` at each budget. Reported per budget: miss rate and misses saved against
exact routing (same system and residency), perplexity and its change against full load,
greedy-token agreement (argmax equal to the full model's at the same position), the substitution
rate and the mean KL per token. Budget 0 is exact routing through the same code path. Every miss is
copied (`miss="copy"`) under the default hardware profile, as when these numbers were first taken.

The simulator replays the same rule on the same text (`simulate(max_kl=...)`, routing and router
logits recorded at full load, the runtime's cost model and start placement): `sim_misses_saved`
next to the runtime's. At budget 0 the two count the same misses; above it the replay keeps the
recorded routing of the layers after a substitution, where the runtime's shifts a little.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def decode(model, requests):
    """(argmax per position, summed NLL of the next token, [n, V] float64 log-probabilities) over
    `requests`, teacher-forced, one token per forward (also `twin_quality.py`'s)."""
    import torch
    from transformers import DynamicCache

    from seqmoe.arch import cache_kwarg

    key, argmax, nll, logp = cache_kwarg(model), [], 0.0, []
    with torch.no_grad():
        for ids in requests:
            cache = DynamicCache(config=model.config)
            for t in range(len(ids) - 1):
                lp = torch.log_softmax(model(torch.tensor([[ids[t]]]), use_cache=True, **{key: cache}).logits[0, -1]
                                       .double(), -1)
                argmax.append(int(lp.argmax()))
                nll -= float(lp[ids[t + 1]])
                logp.append(lp)
    return argmax, nll, torch.stack(logp)


def full_load_reference(tokens: int):
    """(training trace, seqmoe-tiny at float32, held-out requests of about `tokens` tokens (whole
    requests), `decode` of them at full load); the perplexity is printed on stderr (also
    `twin_quality.py`'s)."""
    from seqmoe.arch.collect import load_model
    from seqmoe.arch.tiny.traces import load_demo_traces

    train, test = load_demo_traces()
    off, requests = test.request_offsets, []
    for a, b in zip(off[:-1].tolist(), off[1:].tolist()):
        requests.append(test.token_ids[a:b].tolist())
        if sum(map(len, requests)) >= tokens:
            break
    model, _ = load_model("seqmoe-tiny", device="cpu", dtype="float32")
    full = decode(model, requests)
    print(f"full load: perplexity {math.exp(full[1] / len(full[0])):.3f} over {len(full[0])} positions",
          file=sys.stderr)
    return train, model, requests, full


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="held-out tokens decoded (whole requests)")
    p.add_argument("--budgets", default="0,0.002,0.005,0.01,0.02,0.05,0.2", help="max_kl values, nats per token")
    p.add_argument("--residency", type=float, default=0.25)
    p.add_argument("--system", default="on-demand-lru")
    p.add_argument("--predictor", help="forecaster checkpoint, for the seqmoe systems")
    p.add_argument("--plot", help="write the misses-against-perplexity curve here (.png)")
    p.add_argument("--out", help="JSON file of the rows")
    args = p.parse_args(argv)

    import torch

    from seqmoe.arch.collect import collect_trace
    from seqmoe.config import DEFAULT_HARDWARE
    from seqmoe.brain.manager import SystemInputs, build_system, capacity_for, start_placement
    from seqmoe.runtime import offload
    from seqmoe.sim import simulate

    torch.set_num_threads(1)
    train, model, requests, (full_argmax, full_nll, _) = full_load_reference(args.tokens)
    n = len(full_argmax)
    full_ppl = math.exp(full_nll / n)
    # One forward per request drops each request's last token, as `decode` scores none after it.
    recorded = collect_trace(model, [ids[:-1] for ids in requests], router_logits=True)
    rows, exact_misses, sim_exact = [], None, None
    for budget in (float(b) for b in args.budgets.split(",")):
        rt = offload(model, args.residency, args.system, train=train, predictor=args.predictor,
                     routing="cache-aware", max_kl=budget, miss="copy", hardware=DEFAULT_HARDWARE)
        try:
            argmax, nll, _ = decode(model, requests)
            s = rt.stats()
        finally:
            rt.restore()
        C = capacity_for(args.residency, recorded.num_layers, recorded.num_experts, recorded.top_k)
        system = build_system(args.system, SystemInputs(train=train, test=recorded, capacity=C,
                                                        start=tuple(start_placement(train, C))))
        sim = simulate(recorded, system, model=rt.model_profile, hardware=rt.hardware, capacity=C,
                       start=start_placement(train, C), max_kl=budget)
        sim_exact = sim.misses if sim_exact is None else sim_exact
        misses = s["misses"]
        exact_misses = misses if exact_misses is None else exact_misses
        ppl = math.exp(nll / n)
        rows.append({"max_kl": budget, "system": args.system, "residency": args.residency, "miss_rate": s["miss_rate"],
                     "misses_saved": 1 - misses / exact_misses if exact_misses else 0.0, "perplexity": ppl,
                     "perplexity_change": ppl / full_ppl - 1, "agreement": sum(a == b for a, b in zip(argmax, full_argmax)) / n,
                     "substitution_rate": s["substitution_rate"], "mean_kl": s["mean_kl"], "positions": n,
                     "misses": misses, "sim_misses": sim.misses, "sim_misses_saved": 1 - sim.misses / sim_exact,
                     "sim_substitution_rate": sim.routing["substitution_rate"], "sim_mean_kl": sim.routing["mean_kl"]})
        r = rows[-1]
        print(f"max_kl {budget:<6g} miss rate {r['miss_rate']:.3f} saved {r['misses_saved']:6.1%} (replayed "
              f"{r['sim_misses_saved']:6.1%}) perplexity {ppl:.3f} ({r['perplexity_change']:+.2%}) agreement "
              f"{r['agreement']:.3f} substituted {r['substitution_rate']:.3f} mean KL {r['mean_kl']:.4f}")
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
    x = [100 * r["perplexity_change"] for r in rows]
    y = [100 * r["misses_saved"] for r in rows]
    ax.plot(x, y, "o-")
    for r, xi, yi in zip(rows, x, y):
        ax.annotate(f"{r['max_kl']:g}", (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set_xlabel("perplexity change against full load (%)")
    ax.set_ylabel("misses saved against exact routing (%)")
    ax.set_title(f"cache-aware routing, seqmoe-tiny, {rows[0]['system']} r={rows[0]['residency']:g} (labels: max_kl)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

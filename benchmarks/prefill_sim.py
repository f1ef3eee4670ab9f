"""Time to first token in the simulator (issue 28, item 4; the prefill extension, `seqmoe.sim.prefill`):
each system's pool at every request start of DeepSeek-V2-Lite's unseen prompts (../shared) or, without
them, seqmoe-tiny's shipped held-out routing, priced for prompts of P positions, next to full load,
the bound from the same pool and a cold (empty) pool.

    python benchmarks/prefill_sim.py [--residency 0.45] [--misses copy,auto] [--prompt-lengths 512,2048]

Traces hold few long prompts, so a prompt of P positions is the P tokens from a request's start on
(running into the next requests when it is shorter). The stand-in check compares the experts such
windows touch with those of the training split's genuine prompts of at least P tokens (routed in one
forward each), priced cold: how far the stand-in sits from real long prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from puffin_split import add_shared_flag, deepseek_or_tiny

from seqmoe.config import DEFAULT_HARDWARE, SimConfig
from seqmoe.sim.report.table import write_jsonl
from seqmoe.sim.prefill import full_load_time, prefill_costs, prefill_time, prompt_rows, prompt_starts
from seqmoe.sim.run import load_workload, run_one

COLUMNS = (("ttft_s", "TTFT ms", 1e3), ("ttft_p90_s", "p90 ms", 1e3), ("full_load_ttft_s", "full load ms", 1e3),
           ("vs_full_load", "x full load", 1), ("bound_ttft_s", "bound ms", 1e3), ("cold_ttft_s", "cold pool ms", 1e3),
           ("resident_share", "resident share", 1), ("transfers", "transfers", 1), ("host_experts", "host experts", 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--residency", type=float, default=0.45)
    p.add_argument("--misses", default="copy,auto", help="comma-separated miss paths of every system")
    p.add_argument("--prompt-lengths", default="512,2048")
    p.add_argument("--systems", default="on-demand-lru,moe-infinity-style,seqmoe")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE)
    p.add_argument("--predictor", default=None, help="trained forecaster folder; default: train once, cached")
    p.add_argument("--tiny", action="store_true", help="seqmoe-tiny's shipped routing even when ../shared is there")
    p.add_argument("--out", default="results/prefill-sim.jsonl")
    args = p.parse_args()
    (train, test), profile, name = deepseek_or_tiny(args.shared, args.tiny)
    lengths = tuple(int(n) for n in args.prompt_lengths.split(","))
    base = SimConfig(trace=name, train=name, model_profile=profile, hardware=args.hardware, residency=args.residency,
                     predictor=args.predictor)
    w = load_workload(base, train=train, test=test)
    rows = []
    for miss in args.misses.split(","):
        for s in args.systems.split(","):
            t0 = time.perf_counter()
            cfg = SimConfig(**{**base.to_dict(), "system": s, "miss": miss})
            rows.append(run_one(w, cfg, progress=True, prompt_lengths=lengths))
            print(f"{s} {miss}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(rows, Path(args.out))
    print(f"{name}, r = {args.residency:g}, {args.hardware}, {test.num_tokens} test tokens, {test.num_requests} requests")
    print(table(rows, lengths))
    print(stand_in_check(w, train, test, lengths))
    print(json.dumps({"results": args.out}))
    return 0


def table(rows: list[dict], lengths) -> str:
    """Markdown: a row per system, miss path and prompt length, the fields of `COLUMNS`."""
    lines = ["| system | miss | P | prompts | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 4) + "|"]
    for n in lengths:
        for r in rows:
            p = r["prefill"][str(n)]
            cells = [f"{p[k] * scale:.3g}" if scale != 1 or k != "transfers" else f"{p[k]:.0f}" for k, _, scale in COLUMNS]
            lines.append(f"| {r['system']} | {r['miss']} | {n} | {p['prompts']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stand_in_check(w, train, test, lengths) -> str:
    """Distinct experts and cold / full-load TTFT (copy path) of the stand-in windows of the test split
    against the training split's genuine prompts of at least P tokens (their first P positions)."""
    costs = prefill_costs(w.model, w.hardware)
    E, out = test.num_experts, []
    for n in lengths:
        got = {}
        for label, trace, starts in (
                ("stand-in", test, prompt_starts(test.request_offsets, test.num_tokens, n)),
                ("genuine", train, train.request_offsets[:-1][np.diff(train.request_offsets) >= n])):
            if len(starts) == 0:
                got[label] = "none"
                continue
            stats = []
            for s in starts:
                r = prompt_rows(trace.expert_ids[s:s + n], E)
                stats.append(((r > 0).sum(), full_load_time(r, costs, n),
                              prefill_time(r, np.zeros(r.shape, dtype=bool), costs, "copy", n).time_s))
            d, full, cold = np.mean(stats, axis=0)
            got[label] = f"{len(starts)} prompts, {d:.0f} distinct experts, full load {full * 1e3:.2f} ms, cold {cold * 1e3:.1f} ms"
        out.append(f"P = {n}: stand-in windows {got['stand-in']}; genuine prompts {got['genuine']}")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())

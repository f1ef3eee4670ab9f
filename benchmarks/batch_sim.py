"""Batched decode in the simulator (issue 28): tokens/s, time per step, hit rate and bound fraction
of each system at B = 1, 2, 4, 8, 16 sequences decoded in lockstep (docs/DESIGN.md, "Batched
decode"), on DeepSeek-V2-Lite's unseen prompts (../shared) or, without them, seqmoe-tiny's shipped
held-out routing.

    python benchmarks/batch_sim.py [--residency 0.45] [--miss auto] [--batches 1,2,4,8,16] [--max-tokens 0]
    python benchmarks/batch_sim.py --batches 1,4,8,16 --admissions fifo,overlap --systems on-demand-lru,seqmoe
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from puffin_split import add_shared_flag, deepseek_or_tiny

from seqmoe.config import DEFAULT_HARDWARE, SimConfig
from seqmoe.sim.report.table import write_jsonl
from seqmoe.sim.run import load_workload, run_one

COLUMNS = (("tokens_per_s", "tokens/s", "{:.0f}"), ("full_load_tokens_per_s", "full load tokens/s", "{:.0f}"),
           ("time_per_step_s", "ms/step", "{:.3f}"), ("hit_rate", "hit", "{:.3f}"),
           ("paths_bound_fraction", "paths bound fraction", "{:.3f}"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--residency", type=float, default=0.45)
    p.add_argument("--miss", default="auto", help="miss path of every system (copy, in-place, cpu, auto)")
    p.add_argument("--batches", default="1,2,4,8,16", help="comma-separated batch sizes")
    p.add_argument("--systems", default="on-demand-lru,moe-infinity-style,seqmoe,belady")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE)
    p.add_argument("--max-tokens", type=int, default=0, help="replay the first N test tokens (0: all)")
    p.add_argument("--admissions", default="fifo", help="comma-separated admission rules (fifo, overlap)")
    p.add_argument("--predictor", default=None, help="trained forecaster folder; default: train once, cached")
    p.add_argument("--tiny", action="store_true", help="seqmoe-tiny's shipped routing even when ../shared is there")
    p.add_argument("--out", default="results/batch-sim.jsonl")
    args = p.parse_args()
    (train, test), profile, name = deepseek_or_tiny(args.shared, args.tiny)
    base = SimConfig(trace=name, train=name, model_profile=profile, hardware=args.hardware, residency=args.residency,
                     miss=args.miss, predictor=args.predictor, max_tokens=args.max_tokens or None)
    w = load_workload(base, train=train, test=test.head(args.max_tokens) if args.max_tokens else test)
    systems, batches = args.systems.split(","), [int(b) for b in args.batches.split(",")]
    admissions = args.admissions.split(",")
    rows = []
    for b in batches:
        for a in admissions if b > 1 else admissions[:1]:
            for s in systems:
                t0 = time.perf_counter()
                cfg = SimConfig(**{**base.to_dict(), "system": s, "batch": b, "admission": a})
                rows.append(run_one(w, cfg, progress=True))
                rows[-1]["full_load_tokens_per_s"] = rows[-1]["num_tokens"] / rows[-1]["full_load_time_s"]
                print(f"B={b} {a} {s}: {rows[-1]['tokens_per_s']:.0f} tokens/s ({time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(rows, Path(args.out))
    print(f"{name}, r = {args.residency:g}, miss {args.miss}, {args.hardware}, {rows[0]['num_tokens']} tokens")
    print(table(rows, systems, batches, admissions))
    print(json.dumps({"results": args.out}))
    return 0


def table(rows: list[dict], systems: list[str], batches: list[int], admissions: list[str]) -> str:
    """Markdown: a row per system, batch size and admission rule, the metrics of `COLUMNS`, and tokens/s
    over B = 1's."""
    cell = {(r["system"], r["batch"], r["admission"] if r["batch"] > 1 else "-"): r for r in rows}
    lines = ["| system | B | admission | " + " | ".join(c[1] for c in COLUMNS) + " | x B=1 |",
             "|---" * (len(COLUMNS) + 4) + "|"]
    for s in systems:
        for b, a in [(b, a) for b in batches for a in (admissions if b > 1 else ["-"])]:
            r = cell[s, b, a]
            one = cell.get((s, 1, "-"))
            gain = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}" if one else "-"
            vals = ["-" if r.get(k) is None else fmt.format(r[k] * (1e3 if k == "time_per_step_s" else 1))
                    for k, _, fmt in COLUMNS]
            lines.append(f"| `{s}` | {b} | {a} | " + " | ".join(vals) + f" | {gain} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

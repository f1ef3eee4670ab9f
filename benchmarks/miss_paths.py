"""Three ways to serve a miss (issue 15), on real DeepSeek-V2-Lite routing and two cited hosts.

    python benchmarks/miss_paths.py [--predictor DIR] [--max-tokens 1000] [--out results/bench-miss]

Workload as in `benchmarks/seqmoe_results.py` (the last 200 Puffin prompts of ../shared replayed,
the other 1,599 train). Per hardware profile (default: rtx4090-pcie4, a desktop host with two DDR5
channels and PCIe 4; h100-pcie5, a 12-channel DDR5 server host with PCIe 5; `seqmoe profiles`),
each residency replays `seqmoe` with every miss copied and with `--miss auto`, the host
references `cpu-all` and `static-split-style`, and on-demand LRU both ways. Writes
`OUT/HARDWARE.jsonl`, prints a time table per profile (the fastest realisable system in bold),
then one JSON line. Exits 0 with a note when ../shared is absent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from puffin_split import add_shared_flag, puffin_split
from seqmoe.sim.report.table import write_jsonl
from seqmoe.config import SimConfig
from seqmoe.costs.host_cost import host_expert_time_s
from seqmoe.costs.profiles import copy_time_s
from seqmoe.sim.run import load_workload, run_sweep

RUNS = (("on-demand-lru", "copy"), ("on-demand-lru", "auto"), ("cpu-all", "cpu"), ("static-split-style", "cpu"),
        ("seqmoe", "copy"), ("seqmoe", "auto"))
"""(system, miss path) pairs replayed at each residency."""


def label(row: dict) -> str:
    return f"{row['system']} [{row['miss']}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--predictor", default=None,
                   help="trained forecaster folder (`seqmoe train`); default: train once, cached")
    p.add_argument("--max-tokens", type=int, default=1000, help="replay the first N test tokens (0: all 18,623)")
    p.add_argument("--hardware", default="rtx4090-pcie4,h100-pcie5", help="comma-separated hardware profiles")
    p.add_argument("--residencies", default="0.1,0.25,0.45,0.65", help="comma-separated residencies")
    p.add_argument("--out", default="results/bench-miss", help="output folder")
    args = p.parse_args()
    split = puffin_split(args.shared)
    if split is None:
        return 0
    train, test = split
    residencies = [float(r) for r in args.residencies.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for hw in args.hardware.split(","):
        cfg = SimConfig(trace="puffin[-200:]", train="puffin[:-200]", hardware=hw, predictor=args.predictor,
                        max_tokens=args.max_tokens or None)
        w = load_workload(cfg, train=train, test=test)
        rows = []
        for system, miss in RUNS:
            rows += run_sweep(dataclasses.replace(cfg, miss=miss), [system], residencies, workload=w, progress=True)
        write_jsonl(rows, out / f"{hw}.jsonl")
        files.append(str(out / f"{hw}.jsonl"))
        c, h = copy_time_s(w.model, w.hardware), host_expert_time_s(w.model, w.hardware)
        print(f"\n### {hw}: copy {1e6 * c:.0f} us, host CPU {1e6 * h:.0f} us per expert "
              f"({rows[0]['num_tokens']} tokens)\n")
        print(_table(rows, residencies))
        print(_table(rows, residencies, "decision_us_per_token", "decisions, us per token"))
    print(json.dumps({"results": files, "max_tokens": args.max_tokens}))
    return 0


def _table(rows: list[dict], residencies: list[float], key: str = "time_s", title: str = "") -> str:
    """`key` per (system, miss) x residency; for time_s the fastest in bold, then the paths bound."""
    cell = {(label(r), r["residency"]): r for r in rows}
    names = list(dict.fromkeys(label(r) for r in rows))
    lines = ([f"\n{title}\n"] if title else []) + [
        "| system [miss] | " + " | ".join(f"r={x:g}" for x in residencies) + " |",
        "|---" * (len(residencies) + 1) + "|"]
    best = {x: min(cell[n, x][key] for n in names) if key == "time_s" else None for x in residencies}
    for n in names:
        vals = [cell[n, x][key] for x in residencies]
        lines.append(f"| `{n}` | " + " | ".join(f"**{v:.2f}**" if v == best[x] else f"{v:.2f}"
                                                 for v, x in zip(vals, residencies)) + " |")
    if key == "time_s":
        lines.append("| bound (three paths) | " + " | ".join(f"{cell[names[0], x]['paths_bound_time_s']:.2f}"
                                                             for x in residencies) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

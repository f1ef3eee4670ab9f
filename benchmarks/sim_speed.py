"""Simulator speed: activations replayed per second, per system, on the unseen-prompt DeepSeek trace.

    python benchmarks/sim_speed.py [--systems on-demand-lru,belady] [--shared ../shared]

Replays the last 200 Puffin prompts (about 2.9 M activations) at residency 0.45 on h100-pcie5,
training on the rest. Prints a table, then one JSON line. Exits 0 with a note when the shared
traces are absent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from seqmoe.config import SimConfig
from seqmoe.sim.run import load_workload, run_one
from seqmoe.trace.io import load_trace


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="on-demand-lru,belady,oracle-prefetch")
    p.add_argument("--shared", default=os.environ.get("SEQMOE_SHARED", str(Path(__file__).resolve().parents[2] / "shared")))
    p.add_argument("--residency", type=float, default=0.45)
    args = p.parse_args()
    puffin = Path(args.shared) / "data/traces/deepseek-v2-lite-puffin/puffin"
    if not puffin.is_dir():
        print(f"shared traces not found at {puffin}; nothing to measure", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    trace = load_trace(puffin)
    load_s = time.perf_counter() - t0
    R = trace.num_requests
    cfg = SimConfig(trace="puffin[-200:]", train="puffin[:-200]", residency=args.residency)
    w = load_workload(cfg, train=trace.select_requests(np.arange(R - 200)), test=trace.select_requests(np.arange(R - 200, R)))
    rows = []
    for name in args.systems.split(","):
        row = run_one(w, SimConfig(**(cfg.to_dict() | {"system": name})))
        rows.append({"system": name, "activations": row["activations"], "sim_wall_s": round(row["sim_wall_s"], 3),
                     "activations_per_s": round(row["activations_per_s"]), "hit_rate": round(row["hit_rate"], 4),
                     "decision_us_per_token": round(row["decision_us_per_token"], 1)})
    print(f"import of {R} prompts: {load_s:.1f} s")
    print(f"{'system':26} {'activations':>12} {'wall s':>8} {'act/s':>10} {'hit':>7} {'us/tok':>8}")
    for r in rows:
        print(f"{r['system']:26} {r['activations']:>12} {r['sim_wall_s']:>8.2f} {r['activations_per_s']:>10} "
              f"{r['hit_rate']:>7.4f} {r['decision_us_per_token']:>8.1f}")
    print(json.dumps({"benchmark": "sim_speed", "import_s": round(load_s, 2), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The seqmoe forecaster learned online against the one trained offline and against LRU, simulated.

    python benchmarks/online_learning.py [--residencies 0.25,0.45,0.65] [--out results/online.json]

Each workload's unseen prompts are replayed in order. Online (`SimConfig.online`): no training data
at all, every pool starts empty, `seqmoe` learns its forecaster and its prior from the replayed
routing on the runtime's schedule (`seqmoe.brain.predict.online`). Offline: `seqmoe` with the forecaster
trained on the workload's training split (cached) and that split's prior and start placement.
Reported per residency: decode time over the whole replay and over its second half (the windows
of `window_tokens` = half the tokens), and the online run's swaps. Workloads: seqmoe-tiny's held-out
routing (train: its training routing), and DeepSeek-V2-Lite's last 200 Puffin prompts (train: the
other 1,599; skipped when ../shared is absent). `h100-pcie5`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from puffin_split import add_shared_flag, puffin_split
from seqmoe.config import SimConfig
from seqmoe.sim.run import load_workload, run_one
from seqmoe.arch.tiny.traces import load_demo_traces

RUNS = (("on-demand-lru", True), ("seqmoe", True), ("seqmoe", False))


def _rows(name: str, profile: str, split, residencies) -> list[dict]:
    train, test = split
    cfg = SimConfig(trace="-", model_profile=profile, hardware="h100-pcie5",
                    window_tokens=math.ceil(test.num_tokens / 2))
    w = load_workload(cfg, train=train, test=test)
    rows = []
    for r in residencies:
        for system, online in RUNS:
            t0 = time.perf_counter()
            row = run_one(w, dataclasses.replace(cfg, residency=r, system=system, online=online), progress=True)
            halves = row["windows"]
            rows.append({"workload": name, "residency": r, "system": system, "online": online,
                         "hit_rate": row["hit_rate"], "time_s": row["time_s"], "first_half_s": halves[0]["time_s"],
                         "second_half_s": halves[1]["time_s"], "tokens": row["num_tokens"],
                         "swaps": row.get("forecaster", {}).get("swaps"), "wall_s": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| workload | r | system | trained | hit rate | time s | second half s | vs offline (2nd half) |",
             "|" + "---|" * 8]
    for r in rows:
        off = next(o for o in rows if o["workload"] == r["workload"] and o["residency"] == r["residency"]
                   and o["system"] == "seqmoe" and not o["online"])
        lines.append(f"| {r['workload']} | {r['residency']:g} | `{r['system']}` | {'online' if r['online'] else 'offline'} | "
                     f"{r['hit_rate']:.3f} | {r['time_s']:.2f} | {r['second_half_s']:.2f} | "
                     f"{r['second_half_s'] / off['second_half_s'] - 1:+.1%} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--residencies", default="0.25,0.45,0.65")
    p.add_argument("--out", help="also write the rows to this JSON file")
    args = p.parse_args()
    residencies = [float(x) for x in args.residencies.split(",")]
    rows = _rows("seqmoe-tiny", "seqmoe-tiny", load_demo_traces(), residencies)
    split = puffin_split(args.shared)
    if split is not None:
        rows += _rows("DeepSeek-V2-Lite", "deepseek-v2-lite", split, residencies)
    print(_table(rows))
    print(json.dumps(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

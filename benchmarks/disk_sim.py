"""The disk tier in the simulator on DeepSeek-V2-Lite's real routing (issue 29, item 4): a host cache
of `--host-memory` in front of a PCIe 4 NVMe drive, systems x device residencies x host policies.

    python benchmarks/disk_sim.py [--hardware rtx4090-pcie4] [--host-memory 8GiB] [--residencies 0.1,0.2,0.3]
        [--systems on-demand-lru,seqmoe,moe-infinity-style] [--max-tokens 2000] [--out results/bench-disk]

The Puffin split of ../shared (`puffin_split`: the last 200 prompts replayed); skips with a note when
the shared traces are absent. Prints one table per host policy (tokens/s, disk MB per token, host
hit rate, bound fraction) and the policies' disk bytes per token side by side, then one JSON line;
the rows go to OUT/rows.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from puffin_split import add_shared_flag, puffin_split  # noqa: E402

from seqmoe.config import SimConfig  # noqa: E402
from seqmoe.brain.manager.host_tier import POLICIES  # noqa: E402
from seqmoe.sim.report.table import write_jsonl  # noqa: E402
from seqmoe.sim.run import load_workload, run_one  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--hardware", default="rtx4090-pcie4", help="hardware profile with a disk (default: rtx4090-pcie4)")
    p.add_argument("--host-memory", default="8GiB", help="host cache for expert rows (default: 8GiB)")
    p.add_argument("--residencies", default="0.1,0.2,0.3", help="comma-separated device residencies")
    p.add_argument("--systems", default="on-demand-lru,seqmoe,moe-infinity-style", help="comma-separated systems")
    p.add_argument("--policies", default=",".join(POLICIES), help="host policies to compare (default: lru,forecast)")
    p.add_argument("--max-tokens", type=int, default=2000, help="replay the first N test tokens (0: all)")
    p.add_argument("--predictor", default=None, help="trained forecaster folder; default: the cached one (trained once)")
    p.add_argument("--out", default="results/bench-disk", help="output folder")
    args = p.parse_args()
    split = puffin_split(args.shared)
    if split is None:
        return 0
    train, test = split
    cfg = SimConfig(trace="puffin[-200:]", train="puffin[:-200]", hardware=args.hardware, host_memory=args.host_memory,
                    predictor=args.predictor, max_tokens=args.max_tokens or None)
    w = load_workload(cfg, train=train, test=test)
    residencies = [float(r) for r in args.residencies.split(",")]
    rows = []
    for policy in args.policies.split(","):
        for r in residencies:
            for system in args.systems.split(","):
                row = run_one(w, dataclasses.replace(cfg, system=system, residency=r, host_policy=policy), progress=True)
                rows.append(row)
                print(f"{policy:8} r={r:.2f} {system:20} {row['tokens_per_s']:8.1f} tok/s "
                      f"disk {row['disk_bytes_per_token'] / 1e6:7.2f} MB/tok host hit {row['host_hit_rate']:.3f}",
                      file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(rows, out / "rows.jsonl")
    first = rows[0]
    print(f"\n{args.hardware}, host cache {args.host_memory} = {first['host_rows']} rows (host residency "
          f"{first['host_residency']:.3f}), disk read {first['disk_read_s'] * 1e3:.2f} ms, copy "
          f"{first['copy_time_s'] * 1e3:.2f} ms per expert, {first['num_tokens']} tokens\n")
    for policy in args.policies.split(","):
        print(_table([x for x in rows if x["host_policy"] == policy], policy))
    print(_policies(rows))
    print(json.dumps({"results": str(out / "rows.jsonl"), "hardware": args.hardware, "host_memory": args.host_memory,
                      "max_tokens": args.max_tokens}))
    return 0


def _table(rows: list[dict], policy: str) -> str:
    lines = [f"host policy {policy}:\n", "| system | r | tokens/s | disk MB/token | host hit rate | device hit rate | "
             "disk stall share | bound fraction | paths bound fraction |", "|---" * 9 + "|"]
    for x in rows:
        lines.append(f"| {x['system']} | {x['residency']:.2f} | {x['tokens_per_s']:.1f} | "
                     f"{x['disk_bytes_per_token'] / 1e6:.2f} | {x['host_hit_rate']:.3f} | {x['hit_rate']:.3f} | "
                     f"{x['disk_stall_s'] / x['time_s']:.2f} | {x['bound_fraction']:.3f} | {x['paths_bound_fraction']:.3f} |")
    return "\n".join(lines) + "\n"


def _policies(rows: list[dict]) -> str:
    """Disk MB per token of each (system, residency) under each host policy."""
    policies = list(dict.fromkeys(x["host_policy"] for x in rows))
    cell = {(x["system"], x["residency"], x["host_policy"]): x for x in rows}
    keys = list(dict.fromkeys((x["system"], x["residency"]) for x in rows))
    lines = ["disk MB per token by host policy (ahead reads / used in brackets):\n",
             "| system | r | " + " | ".join(policies) + " |", "|---" * (2 + len(policies)) + "|"]
    for s, r in keys:
        cells = [cell.get((s, r, p)) for p in policies]
        lines.append(f"| {s} | {r:.2f} | " + " | ".join(
            "-" if c is None else f"{c['disk_bytes_per_token'] / 1e6:.2f} ({c['disk_ahead_reads']}/{c['disk_ahead_used']})"
            for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

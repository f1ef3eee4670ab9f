"""The eviction ladder: copies / Belady's copies (hit rate, bound fraction) per system and residency.

    python benchmarks/ladder.py results.jsonl [--systems a,b,...]

Reads a `seqmoe sweep` (or benchmarks/seqmoe_results.py) JSONL file and prints one markdown table:
a row per system, a column per residency, each cell `copies/belady (hit, bound)`; `-` where Belady
copies nothing (every used expert resident from the start).
"""

from __future__ import annotations

import argparse
import sys

from seqmoe.sim.report.table import read_jsonl
from seqmoe.base.errors import UserError


def ladder(rows: list[dict], systems: list[str] | None = None) -> str:
    cell = {(r["system"], r["residency"]): r for r in rows}
    residencies = sorted({r["residency"] for r in rows})
    names = systems or list(dict.fromkeys(r["system"] for r in rows))
    lines = ["| system | " + " | ".join(f"r={x:g}" for x in residencies) + " |", "|---" * (len(residencies) + 1) + "|"]
    for s in names:
        out = []
        for x in residencies:
            r = cell.get((s, x))
            if r is None or not r.get("belady_misses"):
                out.append("-")
            else:
                out.append(f"{r['copies'] / r['belady_misses']:.2f} ({r['hit_rate']:.3f}, {r['bound_fraction']:.3f})")
        lines.append(f"| `{s}` | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a sweep's JSONL file")
    p.add_argument("--systems", default=None, help="comma-separated systems, in this order (default: as in the file)")
    args = p.parse_args()
    try:
        print(ladder(read_jsonl(args.results), args.systems.split(",") if args.systems else None))
    except UserError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""seqmoe, its ablations and every baseline against residency, on real DeepSeek-V2-Lite routing.

    python benchmarks/seqmoe_results.py [--predictor DIR] [--max-tokens 1000] [--out results/bench-seqmoe]

Workload: the last 200 Puffin prompts of ../shared (file order) replayed as batch-1 decode, the
other 1,599 prompts train (statistics, start placement, the forecaster). For each hardware
profile it writes `OUT/HARDWARE.jsonl` (one row per system and residency), the plots
`OUT/HARDWARE/*.png` and the tables of hit rate, full-load fraction and bound fraction into
`OUT/RESULTS.md`; the tables are also printed, then one JSON line with the rows' file names.

Without --predictor it trains the forecaster on the training prompts once (about 10 minutes) and
caches it (`seqmoe.brain.predict.checkpoints`). --max-tokens (default 1000, 0 = all) replays the first N test
tokens, the same for every system: the Python-only systems (seqmoe-greedy-prefetch,
seqmoe-oracle-forecast) take 10-45 ms per token. Exits 0 with a note when ../shared is absent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from puffin_split import add_shared_flag, puffin_split
from seqmoe.sim.report.plot import plot_results
from seqmoe.sim.report.table import write_jsonl
from seqmoe.config import SimConfig
from seqmoe.config import DEFAULT_HARDWARE, DEFAULT_RESIDENCIES
from seqmoe.base.errors import UserError
from seqmoe.brain.manager.systems import oracles, system_spec, systems_with
from seqmoe.sim.run import load_workload, run_sweep

TABLES = {"hit_rate": "Hit rate (ready + late)", "full_load_fraction": "Full-load fraction (full-load time / time)",
          "bound_fraction": "Bound fraction (bound time / time)",
          "copies_per_belady": "Copies / Belady's copies (lower is better)"}  # fmt: skip
LOWER_IS_BETTER = {"copies_per_belady"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--predictor", default=None, help="trained forecaster folder (`seqmoe train`); default: train once, cached")
    p.add_argument("--max-tokens", type=int, default=1000, help="replay the first N test tokens (0: all 18,623)")
    p.add_argument("--hardware", default=f"{DEFAULT_HARDWARE},a100-pcie4", help="comma-separated hardware profiles")
    p.add_argument("--residencies", default=",".join(map(str, DEFAULT_RESIDENCIES)), help="comma-separated residencies")
    p.add_argument("--systems", default=",".join(systems_with("seqmoe", "ablation", "baseline", "oracle")),
                   help="comma-separated systems (default: every registered system)")
    p.add_argument("--out", default="results/bench-seqmoe", help="output folder")
    args = p.parse_args()
    split = puffin_split(args.shared)
    if split is None:
        return 0
    train, test = split
    systems = args.systems.split(",")
    try:
        [system_spec(s) for s in systems]
    except UserError as e:
        p.error(str(e))
    residencies = [float(r) for r in args.residencies.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables, files = [], []
    for hw in args.hardware.split(","):
        cfg = SimConfig(trace="puffin[-200:]", train="puffin[:-200]", hardware=hw, predictor=args.predictor,
                        max_tokens=args.max_tokens or None)
        w = load_workload(cfg, train=train, test=test)
        t0 = time.perf_counter()
        rows = list(run_sweep(cfg, systems, residencies, workload=w, progress=True))
        print(f"{hw}: {len(rows)} replays in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        write_jsonl(rows, out / f"{hw}.jsonl")
        plot_results(rows, out / hw, caption=f"python benchmarks/seqmoe_results.py --max-tokens {args.max_tokens}")
        files.append(str(out / f"{hw}.jsonl"))
        tables.append(_tables(rows, hw, systems, residencies))
    text = "\n\n".join(tables) + "\n"
    (out / "RESULTS.md").write_text(text)
    print(text)
    print(json.dumps({"results": files, "tables": str(out / "RESULTS.md"), "max_tokens": args.max_tokens}))
    return 0


def _tables(rows: list[dict], hw: str, systems: list[str], residencies: list[float]) -> str:
    """Markdown tables (system x residency) of the metrics; the best realisable value in bold."""
    cell = {(r["system"], r["residency"]): r for r in rows}
    head = "| system | " + " | ".join(f"r={x:g}" for x in residencies) + " |"
    rule = "|---" * (len(residencies) + 1) + "|"
    upper = set(oracles())
    parts = [f"### {hw} ({rows[0]['num_tokens']} test tokens)"]
    for key, title in TABLES.items():
        pick = min if key in LOWER_IS_BETTER else max
        best = {x: pick((cell[s, x].get(key) for s in systems if s not in upper and cell[s, x].get(key) is not None),
                        default=None) for x in residencies}
        lines = [f"{title}:", "", head, rule]
        for s in systems:
            vals = [cell[s, x].get(key) for x in residencies]
            txt = ["-" if v is None else f"**{v:.3f}**" if s not in upper and v == best[x] else f"{v:.3f}"
                   for v, x in zip(vals, residencies)]
            lines.append(f"| `{s}` | " + " | ".join(txt) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())

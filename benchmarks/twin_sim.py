"""The twin miss path simulated on Mixtral-8x7B's real routing: decode time and copies against the
budget, for a bf16 and an int8 store at the same device memory.

    python benchmarks/twin_sim.py [--budgets 0,0.25,0.5,1,2] [--out results/twin_sim.json]

The speculative-moe routing holds the router's gate weights (the DeepSeek-V2-Lite traces do not,
so they cannot be replayed with twins). The last 2 prompts are replayed, the other 2 train
(`mixtral_split`); `h100-pcie5`; the device memory is what bf16 experts need at residency 0.25,
filled with bf16 or int8 experts; int4 twins (`SimConfig.twin`) at each budget, gate weight per
token. Budget 0 is the row without twins. Quality is not simulated: `benchmarks/twin_quality.py`
measures it live on seqmoe-tiny. Prints a table, then one JSON line of every row; exits 0 with a
note when ../shared is absent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from puffin_split import add_shared_flag, mixtral_split
from seqmoe.config import SimConfig
from seqmoe.costs.profiles import get_model_profile
from seqmoe.sim.run import load_workload, run_sweep

SYSTEMS = ("on-demand-lru", "seqmoe")
MISSES = ("copy", "auto")
STORES = (None, "int8")


def _rows(split, budgets: list[float]) -> list[dict]:
    train, test = split
    model = get_model_profile("mixtral-8x7b")
    memory = int(np.floor(0.25 * model.num_layers * model.num_experts + 1e-9)) * model.expert_bytes
    cfg = SimConfig(trace="-", model_profile="mixtral-8x7b", hardware="h100-pcie5", expert_memory=str(memory))
    w = load_workload(cfg, train=train, test=test)
    rows = []
    for miss in MISSES:
        for budget in budgets:
            twin = dict(twin="int4", twin_budget=budget) if budget > 0 else {}
            run = dataclasses.replace(cfg, miss=miss, **twin)
            for row in run_sweep(run, SYSTEMS, [cfg.residency], STORES, workload=w, progress=True):
                rows.append({"budget": budget, **{k: row[k] for k in (
                    "system", "miss", "expert_dtype", "capacity", "hit_rate", "misses", "misses_twin", "copies",
                    "bytes_read_twin", "twin_weight_per_token", "time_s", "num_tokens")}})
    for r in rows:
        base = next(b for b in rows if b["budget"] == 0 and all(b[k] == r[k] for k in ("system", "miss", "expert_dtype")))
        r["speedup_vs_no_twin"] = base["time_s"] / r["time_s"]
    return rows


def _table(rows: list[dict]) -> str:
    head = "| system | miss | store | twin budget | slots | misses | from twins | copies | time s | vs no twin |"
    lines = [head, "|" + "---|" * 10]
    for r in sorted(rows, key=lambda r: (r["miss"], r["expert_dtype"] or "", r["system"], r["budget"])):
        lines.append(f"| `{r['system']}` | {r['miss']} | {r['expert_dtype'] or 'bf16'} | {r['budget']:g} | {r['capacity']} | "
                     f"{r['misses']} | {r['misses_twin']} | {r['copies']} | {r['time_s']:.2f} | "
                     f"{r['speedup_vs_no_twin']:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--budgets", default="0,0.25,0.5,1,2", help="twin budgets, gate weight per token (0: no twin)")
    p.add_argument("--out", help="also write the rows to this JSON file")
    args = p.parse_args()
    split = mixtral_split(args.shared)
    if split is None:
        return 0
    rows = _rows(split, [float(b) for b in args.budgets.split(",")])
    print(_table(rows))
    print(json.dumps(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

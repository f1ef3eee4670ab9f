"""Quantized experts at equal device memory, simulated on real routing: DeepSeek-V2-Lite (Puffin) and
Mixtral-8x7B traces, bf16 against int8, fp8 and int4 stores.

    python benchmarks/precision_memory.py [--max-tokens 1000] [--out results/precision_memory.json]

The budget is the bytes bf16 experts need at residency 0.25 on each model's profile; each precision
fills it with as many of its (smaller) experts as fit (`SimConfig.memory`, `expert_dtype`), and
every system replays the same unseen prompts with every miss copied and with `--miss auto`.
DeepSeek-V2-Lite: the last 200 Puffin prompts replayed, the other 1,599 train (`puffin_split`);
Mixtral-8x7B: the speculative-moe routing (4 prompts), the last 2 replayed. The seqmoe forecaster
trains once per trace (cached, about 10 minutes for DeepSeek). Prints one table per model, then one
JSON line of every row; exits 0 with a note when ../shared is absent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from puffin_split import add_shared_flag, mixtral_split, puffin_split
from seqmoe.config import SimConfig
from seqmoe.costs.profiles import get_model_profile
from seqmoe.sim.run import load_workload, run_sweep

PRECISIONS = (None, "int8", "fp8", "int4")
SYSTEMS = ("on-demand-lru", "seqmoe")
MISSES = ("copy", "auto")


def _rows(name: str, profile: str, split, max_tokens: int | None) -> list[dict]:
    train, test = split
    model = get_model_profile(profile)
    budget = int(np.floor(0.25 * model.num_layers * model.num_experts + 1e-9)) * model.expert_bytes
    cfg = SimConfig(trace="-", model_profile=profile, hardware="h100-pcie5", expert_memory=str(budget),
                    max_tokens=max_tokens)
    w = load_workload(cfg, train=train, test=test)
    rows = []
    for miss in MISSES:
        for row in run_sweep(dataclasses.replace(cfg, miss=miss), SYSTEMS, [cfg.residency], PRECISIONS, workload=w,
                             progress=True):
            rows.append({"model": name, "budget_bytes": budget, **{k: row[k] for k in (
                "system", "miss", "expert_dtype", "capacity", "residency", "hit_rate", "misses", "copies", "time_s",
                "full_load_fraction", "num_tokens")}, "expert_bytes": row["model_profile"]["expert_bytes"]})
    for r in rows:
        base = next(b for b in rows if b["system"] == r["system"] and b["miss"] == r["miss"] and b["expert_dtype"] is None)
        r["speedup_vs_bf16"] = base["time_s"] / r["time_s"]
    return rows


def _table(rows: list[dict]) -> str:
    head = "| system | miss | experts | bytes/expert | slots (residency) | hit rate | time s | vs bf16 |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| `{r['system']}` | {r['miss']} | {r['expert_dtype'] or 'bf16'} | {r['expert_bytes'] / 2**20:.2f} MiB | "
                     f"{r['capacity']} ({r['residency']:.3f}) | {r['hit_rate']:.3f} | {r['time_s']:.2f} | "
                     f"{r['speedup_vs_bf16']:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--max-tokens", type=int, default=1000, help="replay the first N test tokens (0: all)")
    p.add_argument("--out", help="also write the rows to this JSON file")
    args = p.parse_args()
    rows = []
    for name, profile, split in (("DeepSeek-V2-Lite", "deepseek-v2-lite", puffin_split(args.shared)),
                                 ("Mixtral-8x7B", "mixtral-8x7b", mixtral_split(args.shared))):
        if split is None:
            continue
        part = _rows(name, profile, split, args.max_tokens or None)
        budget = part[0]["budget_bytes"]
        print(f"\n{name} ({profile} on h100-pcie5), {part[0]['num_tokens']} test tokens, expert memory "
              f"{budget / 2**30:.2f} GiB (bf16 at r = 0.25)\n\n{_table(part)}")
        rows += part
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

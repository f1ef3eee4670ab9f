"""How far ahead the forecaster sees, with and without guessed next tokens, and what it buys.

    python benchmarks/far_sight.py [--recall-tokens 1000] [--sim-tokens 2000] [--out results/far_sight.json]

1. recall@K of the trained forecaster (`SeqPredictor.forecast`, recursion past the next token) at
   1, 2, 5, 10 and 20 tokens ahead, scored after each token's first layer: no drafts, the n-gram
   drafter (`seqmoe.brain.predict.drafters.NgramDrafter`, its hit rates counted on the training split),
   and the true next tokens (the ceiling of drafting).
2. The simulator (`h100-pcie5`, copy-only): each lever alone (`SIM_RUNS`) against the two-token
   forecast and `moe-infinity-style`, as copies / Belady's misses and time.

Workloads: seqmoe-tiny's held-out routing (train: its training routing), and DeepSeek-V2-Lite's last
200 Puffin prompts (train: the other 1,599; skipped when ../shared is absent). The forecasters are
trained once per training split and cached (`seqmoe.brain.predict.provide.seq_predictor_for`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from puffin_split import add_shared_flag, puffin_split
from seqmoe.config import SimConfig
from seqmoe.brain.predict.provide import seq_predictor_for
from seqmoe.brain.predict.drafters import TrueTokenDrafter, make_drafter
from seqmoe.brain.predict.evaluate import evaluate_predictor
from seqmoe.sim.run import load_workload, run_one
from seqmoe.arch.tiny.traces import load_demo_traces

HORIZON_TOKENS = (1, 2, 5, 10, 20)
SIM_RUNS = (("seqmoe-no-far-head", "none"), ("seqmoe-no-far-head", "ngram"), ("seqmoe-oracle-draft", "none"),
            ("seqmoe", "none"), ("moe-infinity-style", "none"))
"""(system, drafter): the two-token forecast alone (seqmoe before the long-range head), with n-gram drafts,
with true-token drafts (the ceiling), the long-range head (seqmoe), a baseline. Drafts feed the next
token's forecast, which the head replaces, so seqmoe with drafts is seqmoe."""


def recall_rows(name: str, train, test, tokens: int) -> list[dict]:
    predictor = seq_predictor_for(None, train, progress=True)
    head = test.head(min(tokens, test.num_tokens))
    L = head.num_layers
    rows = []
    for draft in ("none", "ngram", "true tokens"):
        p = predictor.with_window(None)
        p.check_trace(head)
        p.use_drafter(TrueTokenDrafter(head) if draft == "true tokens" else make_drafter(draft, train))
        res = evaluate_predictor(head, p, horizons=[h * L for h in HORIZON_TOKENS], stride=L, progress=True, desc=draft)
        rows.append({"workload": name, "draft": draft, "tokens": head.num_tokens,
                     "recall_at_k": {h: res["recall_at_k"][h * L] for h in HORIZON_TOKENS}})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def sim_rows(name: str, profile: str, train, test, residencies, tokens: int) -> list[dict]:
    cfg = SimConfig(trace="-", model_profile=profile, hardware="h100-pcie5", max_tokens=tokens)
    w = load_workload(cfg, train=train, test=test)
    rows = []
    for r in residencies:
        for system, draft in SIM_RUNS:
            row = run_one(w, dataclasses.replace(cfg, residency=r, system=system, draft=draft), progress=True)
            rows.append({"workload": name, "residency": r, "system": system, "draft": draft,
                         "copies_over_belady": row["copies"] / row["belady_misses"] if row["belady_misses"] else None,
                         "time_s": row["time_s"],
                         "hit_rate": row["hit_rate"], "bound_fraction": row["bound_fraction"],
                         "decision_us_per_token": row["decision_us_per_token"], "tokens": row["num_tokens"]})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _num(x) -> str:
    return "-" if x is None else f"{x:.3f}"  # "-": Belady copies nothing


def tables(recall: list[dict], sim: list[dict]) -> str:
    lines = ["| workload | draft | " + " | ".join(f"{h} tok" for h in HORIZON_TOKENS) + " |",
             "|" + "---|" * (2 + len(HORIZON_TOKENS))]
    for r in recall:
        lines.append(f"| {r['workload']} | {r['draft']} | "
                     + " | ".join(f"{r['recall_at_k'][h]:.3f}" for h in HORIZON_TOKENS) + " |")
    lines += ["", f"| workload | r | system | draft | copies / Belady | time s | vs {SIM_RUNS[0][0]} | decision us/token |",
              "|" + "---|" * 8]
    for r in sim:
        base = next(b for b in sim if b["workload"] == r["workload"] and b["residency"] == r["residency"]
                    and b["system"] == SIM_RUNS[0][0] and b["draft"] == "none")
        lines.append(f"| {r['workload']} | {r['residency']:g} | `{r['system']}` | {r['draft']} | "
                     f"{_num(r['copies_over_belady'])} | {r['time_s']:.3f} | {r['time_s'] / base['time_s'] - 1:+.1%} | "
                     f"{r['decision_us_per_token']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--recall-tokens", type=int, default=1000, help="replayed tokens scored for recall")
    p.add_argument("--sim-tokens", type=int, default=2000, help="replayed tokens per simulated run")
    p.add_argument("--residencies", default="0.25,0.45,0.65")
    p.add_argument("--out", default="results/far_sight.json")
    args = p.parse_args()
    residencies = [float(x) for x in args.residencies.split(",")]
    workloads = [("seqmoe-tiny", "seqmoe-tiny", *load_demo_traces())]
    split = puffin_split(args.shared)
    if split is not None:
        workloads.append(("DeepSeek-V2-Lite", "deepseek-v2-lite", *split))
    recall, sim = [], []
    for name, profile, train, test in workloads:
        recall += recall_rows(name, train, test, args.recall_tokens)
        sim += sim_rows(name, profile, train, test, residencies, args.sim_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"recall": recall, "sim": sim}, indent=1) + "\n")
    print(tables(recall, sim))


if __name__ == "__main__":
    main()

"""Decision cost per token of every system, and the simulator's speed, on one thread.

    python benchmarks/sim_speed.py [--predictor DIR] [--systems a,b] [--tokens 1000] [--shared ../shared]

Two workloads, both replayed at residency 0.45 on h100-pcie5 with each system's own manager (the
compiled one where the system has it, `seqmoe.brain.manager.build_manager`):
- DeepSeek-V2-Lite dimensions (26 layers x 64 experts, top-6): the first --tokens of the last
  200 Puffin prompts of ../shared, the other prompts train; the seqmoe systems need --predictor
  (a forecaster trained on those prompts, `seqmoe train`) and are skipped without it. Skipped
  with a note when ../shared is absent.
- seqmoe-tiny dimensions: the embedded demo routing; the forecaster is the demo's (trained once
  and cached, about 20 s).
For each (workload, system): decision microseconds per token (host time inside the manager's
decision calls: predictor, scheduler, eviction, bookkeeping; the median of --repeats runs),
simulated activations per second of wall time, and the hit rate. Prints a table, then one JSON
line. Numbers are for an otherwise idle machine: a busy one inflates them.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one thread, as the budgets are stated; before numpy loads

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402


from seqmoe.config import SimConfig  # noqa: E402
from seqmoe.base.errors import UserError  # noqa: E402
from seqmoe.brain.manager.systems import SYSTEMS, system_spec  # noqa: E402
from seqmoe.sim.run import load_workload, run_one  # noqa: E402
from puffin_split import add_shared_flag, puffin_split  # noqa: E402


def _workloads(args):
    """(name, SimConfig, train, test) of each workload that can run here."""
    split = puffin_split(args.shared)
    if split is not None:
        train, test = split
        cfg = SimConfig(trace="puffin[-200:]", train="puffin[:-200]", residency=args.residency,
                        max_tokens=args.tokens, predictor=args.predictor)
        yield "deepseek-v2-lite", cfg, train, test
    from seqmoe.cli.demo import demo_predictor
    from seqmoe.arch.tiny.traces import load_demo_traces

    train, test = load_demo_traces()
    cfg = SimConfig(trace="embedded:seqmoe-tiny-test", train="embedded:seqmoe-tiny-train", model_profile="seqmoe-tiny",
                    residency=args.residency, max_tokens=args.tokens, predictor=str(demo_predictor(train)))
    yield "seqmoe-tiny", cfg, train, test


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(n for n, s in SYSTEMS.items()), help="comma-separated systems")
    p.add_argument("--predictor", default=None, help="forecaster of the DeepSeek-V2-Lite training prompts (`seqmoe train`)")
    p.add_argument("--tokens", type=int, default=1000, help="tokens replayed per run (default: 1000)")
    p.add_argument("--residency", type=float, default=0.45)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per (workload, system); the median is reported (this VM's speed varies by +-20%%)")
    add_shared_flag(p)
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    systems = args.systems.split(",")
    try:
        [system_spec(s) for s in systems]
    except UserError as e:
        p.error(str(e))
    rows = []
    for workload, cfg, train, test in _workloads(args):
        w = load_workload(cfg, train=train, test=test)
        warm = load_workload(SimConfig(**(cfg.to_dict() | {"max_tokens": 30})), train=train, test=test)
        warm.predictors.update(w.predictors)
        for name in systems:
            if SYSTEMS[name].needs_predictor and cfg.predictor is None:
                print(f"{workload}: {name} skipped (no --predictor)", file=sys.stderr)
                continue
            run_cfg = SimConfig(**(cfg.to_dict() | {"system": name}))
            run_one(warm, run_cfg)  # warm-up: loads the compiled kernels (compiles them the first time)
            w.predictors.update(warm.predictors)
            runs = [run_one(w, run_cfg) for _ in range(args.repeats)]
            row = sorted(runs, key=lambda r: r["decision_us_per_token"])[len(runs) // 2]  # the median run
            us = [round(r["decision_us_per_token"], 1) for r in runs]
            rows.append({"workload": workload, "system": name, "tokens": row["num_tokens"],
                         "decision_us_per_token": round(row["decision_us_per_token"], 1),
                         "decision_us_per_token_runs": us,
                         "activations_per_s": round(row["activations_per_s"]), "sim_wall_s": round(row["sim_wall_s"], 2),
                         "hit_rate": round(row["hit_rate"], 4)})
            print(f"{workload}: {name} {rows[-1]['decision_us_per_token']} us/token (runs: {us})", file=sys.stderr)
    print(f"{'workload':18} {'system':26} {'decision us/token (median)':>27} {'activations/s':>14} {'hit':>7}")
    for r in rows:
        print(f"{r['workload']:18} {r['system']:26} {r['decision_us_per_token']:>27.1f} {r['activations_per_s']:>14} "
              f"{r['hit_rate']:>7.4f}")
    print(json.dumps({"benchmark": "sim_speed", "residency": args.residency, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A sweep serial and as Ray tasks on a local Ray (issue 30): wall time of each, and rows the same.

    python benchmarks/ray_speedup.py [--workload deepseek|tiny] [--systems a,b] [--residencies 0.25,0.45]
        [--max-tokens N] [--address ADDRESS] [--shared ../shared] [--out results/ray_sweep.json]

Five systems the Python reference manager runs (none has a compiled manager) at two residencies: 10
runs, on DeepSeek-V2-Lite's Puffin split of ../shared (`puffin_split`, the first --max-tokens of
its 200 replayed prompts; default 6,000) or on the embedded seqmoe-tiny workload (every held-out
token by default). The serial sweep
is `run_sweep` in this process; the Ray sweep is `ray_sweep`, timed from starting Ray to its shutdown
(a worker per core; on a cluster with --address, its workers). Prints each run's simulation time,
both wall times and the speedup, whether every row matches apart from the wall-clock fields
(`WALL_CLOCK_FIELDS`), then one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from puffin_split import add_shared_flag, puffin_split  # noqa: E402

from seqmoe.config import SimConfig  # noqa: E402
from seqmoe.sim.ray_sweep import ray_sweep  # noqa: E402
from seqmoe.sim.run import WALL_CLOCK_FIELDS, load_workload, run_sweep, sweep_runs  # noqa: E402
from seqmoe.arch.tiny.traces import TEST_FILE, TRAIN_FILE  # noqa: E402

REFERENCE_SYSTEMS = "on-demand-lfu,mixtral-offloading-style,moe-infinity-style,affinity-style,expertflow-style"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=REFERENCE_SYSTEMS, help=f"comma-separated systems (default: {REFERENCE_SYSTEMS})")
    p.add_argument("--residencies", default="0.25,0.45", help="comma-separated residencies (default: 0.25,0.45)")
    p.add_argument("--workload", choices=("deepseek", "tiny"), default="deepseek", help="DeepSeek-V2-Lite's routing "
                   "of ../shared (skipped with a note when absent) or the embedded seqmoe-tiny's (default: deepseek)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="replay the first N test tokens (default: 6000 on deepseek, all on tiny)")
    add_shared_flag(p)
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: a local Ray started here)")
    p.add_argument("--out", default="results/ray_sweep.json", help="JSON summary (default: results/ray_sweep.json)")
    args = p.parse_args()
    if args.workload == "deepseek":
        split = puffin_split(args.shared)
        if split is None:
            return 0
        cfg = SimConfig(trace="puffin[-200:]", train="puffin[:-200]", residency=1.0, max_tokens=args.max_tokens or 6000)
        load = lambda: load_workload(cfg, train=split[0], test=split[1])  # noqa: E731
    else:
        cfg = SimConfig(trace=str(TEST_FILE), train=str(TRAIN_FILE), model_profile="seqmoe-tiny", residency=1.0,
                        max_tokens=args.max_tokens)
        load = lambda: load_workload(cfg)  # noqa: E731
    systems, residencies = args.systems.split(","), [float(r) for r in args.residencies.split(",")]
    runs = sweep_runs(cfg, systems, residencies)

    t0 = time.perf_counter()  # both timed from their loaded workloads
    serial = list(run_sweep(cfg, systems, residencies, keep_going=True, workload=load()))
    serial_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    parallel = ray_sweep(runs, address=args.address, workloads={cfg.trace: load()})  # its own: no Belady counts cached
    ray_s = time.perf_counter() - t0

    same = [{k: v for k, v in a.items() if k not in WALL_CLOCK_FIELDS} == {k: v for k, v in b.items() if k not in WALL_CLOCK_FIELDS}
            for a, b in zip(serial, parallel)]
    print(f"{'system':26} {'resid.':>6} {'serial sim s':>12} {'ray sim s':>9}  same row")
    for a, b, ok in zip(serial, parallel, same):
        print(f"{a['system']:26} {a['residency']:>6.2f} {a.get('sim_wall_s', float('nan')):>12.2f} "
              f"{b.get('sim_wall_s', float('nan')):>9.2f}  {ok}" + (f"  {a['error']}" if "error" in a else ""))
    summary = {"workload": args.workload, "runs": len(runs), "tokens": serial[0].get("num_tokens"), "cores": os.cpu_count(),
               "address": args.address, "serial_s": serial_s, "ray_s": ray_s, "speedup": serial_s / ray_s,
               "rows_equal": all(same) and len(serial) == len(parallel),
               "failed_runs": sum("error" in r for r in serial + parallel)}
    print(f"\n{len(runs)} runs: serial {serial_s:.1f} s, Ray {ray_s:.1f} s (Ray started and stopped included): "
          f"{summary['speedup']:.2f}x; rows equal apart from wall-clock fields: {summary['rows_equal']}")
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary) + "\n")
    return 0 if summary["rows_equal"] and not summary["failed_runs"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""`seqmoe demo|sim|sweep|plot|systems|profiles`: replays of routing traces against the cost model,
their tables and plots, and the lists of systems and profiles.

    seqmoe sim --trace TEST --train TRAIN --model-profile deepseek-v2-lite --hardware h100-pcie5 \\
        --residency 0.45 --system on-demand-lru --json
    seqmoe sweep --trace TEST --train TRAIN --out results.jsonl --plot plots/
    seqmoe plot results.jsonl --out plots/
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from seqmoe.base.errors import UserError
from seqmoe.base.files import check_output
from seqmoe.brain.manager.systems import ROLES, SYSTEMS, baselines, systems_with
from seqmoe.cli.args import add_config_flags, config_from_args, floats, progress, prompt_lengths
from seqmoe.cli.demo import run_demo
from seqmoe.config import DEFAULT_RESIDENCIES, SimConfig
from seqmoe.costs.precision import PRECISIONS, SHIPPED
from seqmoe.costs.profiles import HARDWARE_PROFILES, MODEL_PROFILES, get_hardware_profile
from seqmoe.sim.ray_sweep import ray_sweep
from seqmoe.sim.report.plot import plot_results
from seqmoe.sim.report.table import format_table, read_jsonl, write_jsonl
from seqmoe.sim.run import load_workload, run_one, run_sweep, sweep_runs

_RESIDENCIES = ",".join(map(str, DEFAULT_RESIDENCIES))


def _names(text: str) -> list[str]:
    if text == "baselines":
        return baselines()
    return systems_with(*ROLES) if text == "all" else [x.strip() for x in text.split(",") if x.strip()]


def cmd_sim(args) -> int:
    cfg = config_from_args(SimConfig, args)
    row = run_one(load_workload(cfg), cfg, progress=progress(args), prompt_lengths=args.prompt_lengths)
    print(format_table([row]))
    if "host_rows" in row:
        print(_disk_line(row))
    for n, p in row.get("prefill", {}).items():
        print(f"time to first token, {n}-token prompts ({p['prompts']}): {p['ttft_s'] * 1e3:.2f} ms, full load "
              f"{p['full_load_ttft_s'] * 1e3:.2f} ms ({p['vs_full_load']:.2f}x), bound {p['bound_ttft_s'] * 1e3:.2f} ms, "
              f"cold pool {p['cold_ttft_s'] * 1e3:.2f} ms")
    if args.out:
        write_jsonl([row], args.out)
    if args.json:
        print(json.dumps(row))
    return 0


def cmd_sweep(args) -> int:
    traces, hardware = _list(args.trace, "--trace"), _list(args.hardware or SimConfig.DEFAULTS["hardware"], "--hardware")
    for h in hardware:
        get_hardware_profile(h)  # an unknown profile fails now, not in its runs
    cfg = config_from_args(SimConfig, args, system="on-demand-lru", residency=None if args.expert_memory else 1.0,
                           trace=traces[0], hardware=hardware[0])
    systems, residencies = _names(args.systems), floats(args.residencies, "--residencies")
    if cfg.expert_memory is not None and args.residencies != _RESIDENCIES:
        raise UserError("give --residencies or --expert-memory, not both")
    check_output(args.out, "--out")  # before the runs: a sweep's rows must have somewhere to go
    if args.plot:
        check_output(args.plot, "--plot", folder=True)
    dtypes = [None if p.strip() in ("", "none") else p.strip() for p in args.expert_dtypes.split(",")]
    runs = sweep_runs(cfg, systems, residencies, dtypes, traces=traces, hardware=hardware)
    arrived = []

    def show(row: dict) -> None:
        arrived.append(row)
        where = [row["config"][k] for k, many in (("trace", traces), ("hardware", hardware)) if len(many) > 1]
        print(" ".join(where + [_row_line(row)]), file=sys.stderr)

    try:
        if args.ray is not None:
            rows = ray_sweep(runs, address=args.ray or None, progress=progress(args), on_row=show,
                             prompt_lengths=args.prompt_lengths)
        else:
            rows = arrived
            for row in run_sweep(cfg, systems, residencies, dtypes, progress=progress(args), keep_going=True,
                                 prompt_lengths=args.prompt_lengths, traces=traces, hardware=hardware):
                show(row)
    except KeyboardInterrupt:
        print(f"seqmoe: interrupted after {len(arrived)} of {len(runs)} runs; {args.out} not written", file=sys.stderr)
        return 130
    print(format_table(rows))
    write_jsonl(rows, args.out)
    failed = [r for r in rows if "error" in r]
    if args.plot and len(failed) < len(rows):
        plot_results(rows, args.plot, caption="seqmoe " + shlex.join(args.argv))
    if failed:
        print(f"seqmoe: {len(failed)} of {len(rows)} runs failed; their rows in {args.out} say why (\"error\")",
              file=sys.stderr)
        return 1
    return 0


def _add_prompt_lengths(parser) -> None:
    parser.add_argument("--prompt-lengths", type=prompt_lengths, default=(), metavar="N,N",
                        help="also the time to first token of prompts of these many positions, from each system's "
                        "pool at every request start (docs/DESIGN.md, prefill extension; batch 1; default: none)")


def _list(text: str, flag: str) -> list[str]:
    """The comma-separated values of `flag` (a sweep runs each)."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out:
        raise UserError(f"{flag} is empty")
    return out


def _row_line(row: dict) -> str:
    """One run's line as its row arrives."""
    head = f"{row['system']:>26} {row['expert_dtype'] or '':>4} r={row['residency']:.2f}"
    if "error" in row:
        return f"{head} FAILED: {row['error']}"
    return (f"{head} hit={row['hit_rate']:.4f} full-load={row['full_load_fraction']:.3f} "
            f"bound={row['bound_fraction']:.3f}" + (" " + _disk_line(row) if "host_rows" in row else ""))


def _disk_line(row: dict) -> str:
    """The disk tier's numbers of a result row."""
    return (f"host cache {row['host_rows']} rows (host residency {row['host_residency']:.3f}, {row['host_policy']}): "
            f"hit {row['host_hit_rate']:.4f}, disk {row['disk_bytes_per_token'] / 1e6:.2f} MB/token, "
            f"disk stall {row['disk_stall_s']:.3f} s")


def cmd_plot(args) -> int:
    check_output(args.out, "--out", folder=True)
    for path in plot_results(read_jsonl(args.results), args.out, caption=args.caption or ""):
        print(path)
    return 0


def cmd_systems(args) -> int:
    for spec in SYSTEMS.values():
        print(f"{spec.name:26} {spec.role:9} {spec.summary}")
    return 0


def cmd_profiles(args) -> int:
    print(f"{'model profile':18} {'L':>3} {'E':>4} {'K':>2} {'MB/expert':>10}  source")
    for m in MODEL_PROFILES.values():
        print(f"{m.name:18} {m.num_layers:>3} {m.num_experts:>4} {m.top_k:>2} {m.expert_bytes / 1e6:>10.2f}  {m.source}")
    print(f"\n{'hardware profile':18} {'H2D GB/s':>9} {'alpha us':>9} {'HBM GB/s':>9} {'host GB/s':>9} "
          f"{'cores':>5}  source")
    for h in HARDWARE_PROFILES.values():
        host = (f"{h.host_memory_bytes_per_s / 1e9:>9.1f} {h.host_cores:>5}" if h.host_cores else f"{'-':>9} {'-':>5}")
        print(f"{h.name:18} {h.h2d_bytes_per_s / 1e9:>9.1f} {h.copy_overhead_s * 1e6:>9.1f} "
              f"{h.hbm_bytes_per_s / 1e9:>9.0f} {host}  {h.source}")
    return 0


def cmd_demo(args) -> int:
    run_demo(num_tokens=args.tokens, out_dir=args.out, forecaster_minutes=args.forecaster_minutes,
             progress=progress(args), json_line=args.json)
    return 0


def add_sim_commands(sub: argparse._SubParsersAction) -> None:
    """Add the replay commands to the main parser's subparsers."""
    demo = sub.add_parser("demo", help="compare all systems on the embedded seqmoe-tiny workload",
                          description="Replay the routing of seqmoe-tiny (our own MoE model, shipped) over held-out "
                          "Python source with every baseline and seqmoe at three residencies, after training the "
                          "forecaster on its training part once (cached); print a table and write JSONL and plots.")
    demo.add_argument("--tokens", type=int, default=3000, help="test tokens to replay (default: 3000)")
    demo.add_argument("--forecaster-minutes", type=float, default=2.5,
                      help="time cap for training the forecaster the first time (default: 2.5)")
    demo.add_argument("--out", default="results/demo", help="folder for results.jsonl and plots (default: results/demo)")
    demo.add_argument("--json", action="store_true", help="also print the summary rows as one JSON line, last")
    demo.set_defaults(func=cmd_demo)

    sim = sub.add_parser("sim", help="replay a trace with one system at one residency",
                         description="Replay --trace as batch-1 decode under the cost model of --model-profile on "
                         "--hardware, with --system managing a pool of floor(residency x L x E) expert slots.")
    add_config_flags(sim, SimConfig)
    sim.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    _add_prompt_lengths(sim)
    sim.add_argument("--out", help="also write the result row to this JSONL file")
    sim.set_defaults(func=cmd_sim)

    sweep = sub.add_parser("sweep", help="replay systems x residencies into a JSONL file",
                           description="Run every (trace, hardware profile, residency, precision, system) on the "
                           "workloads; rows go to --out in that order (a run that fails gives a row saying why, and "
                           "the exit status is 1). --trace and --hardware take comma-separated lists here.")
    add_config_flags(sweep, SimConfig, skip=("system", "residency", "expert_dtype"))
    sweep.add_argument("--systems", default="baselines",
                       help="comma-separated system names, 'baselines' (default: those that need no forecaster) or 'all'")
    sweep.add_argument("--residencies", default=_RESIDENCIES, help=f"comma-separated residencies (default: {_RESIDENCIES})")
    sweep.add_argument("--expert-dtypes", default="none", metavar="PRECISIONS", help="comma-separated precisions of "
                       f"the expert store (none: the model profile's; {', '.join(PRECISIONS)}, or a format checkpoints "
                       f"ship in: {', '.join(SHIPPED)}); with --expert-memory they compare at equal memory (default: none)")
    _add_prompt_lengths(sweep)
    sweep.add_argument("--out", required=True, help="JSONL file for the result rows")
    sweep.add_argument("--plot", metavar="DIR", help="also draw the plots into DIR")
    sweep.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                       help="run each run as a Ray task (pip install 'seqmoe[ray]'): with no ADDRESS on a local Ray "
                       "started for the sweep (a worker per core), else on the cluster at ADDRESS (auto, host:port "
                       "or ray://host:10001; seqmoe installed on every node). Rows are the serial sweep's, in its order")
    sweep.set_defaults(func=cmd_sweep)

    plot = sub.add_parser("plot", help="draw hit rate, full-load and bound fraction against residency",
                          description="Read a results JSONL file (from sweep) and write one PNG per metric.")
    plot.add_argument("results", help="results JSONL file")
    plot.add_argument("--out", required=True, help="folder for the PNG files")
    plot.add_argument("--caption", help="text under each figure (e.g. the command that made the results)")
    plot.set_defaults(func=cmd_plot)

    systems = sub.add_parser("systems", help="list the memory-management systems")
    systems.set_defaults(func=cmd_systems)

    profiles = sub.add_parser("profiles", help="list the model and hardware profile presets")
    profiles.set_defaults(func=cmd_profiles)

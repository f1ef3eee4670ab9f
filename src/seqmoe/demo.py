"""`seqmoe demo`: every system at three residencies on the embedded synthetic workload.

The workload is generated from statistics fitted to real DeepSeek-V2-Lite routing (popularity per
layer, token-to-token reuse, inter-layer transitions; `seqmoe/data/`), never the traces themselves,
so the demo needs no downloads and no `../shared`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from seqmoe.bench.plot import plot_results
from seqmoe.bench.report import format_table, write_jsonl
from seqmoe.config import SimConfig
from seqmoe.errors import UserError
from seqmoe.sim.run import load_workload, run_sweep
from seqmoe.systems import baselines
from seqmoe.trace.synthetic import generate_trace, load_default_params

RESIDENCIES = (0.25, 0.45, 0.65)


def run_demo(*, num_tokens: int = 1500, out_dir: str | Path = "results/demo", progress: bool = False) -> list[dict]:
    """Generate the workload, replay all systems, print a table and a JSON line, write JSONL and plots."""
    if num_tokens < 50:
        raise UserError(f"--tokens must be at least 50, got {num_tokens}")
    params = load_default_params()
    train = generate_trace(params, 4 * num_tokens, seed=1)
    test = generate_trace(params, num_tokens, seed=2)
    cfg = SimConfig(trace="embedded:synthetic-deepseek-v2-lite", train="embedded:synthetic-deepseek-v2-lite",
                    model_profile="deepseek-v2-lite", hardware="h100-pcie5")
    workload = load_workload(cfg, train=train, test=test)
    print(f"seqmoe demo: {num_tokens} synthetic DeepSeek-V2-Lite tokens ({test.num_requests} requests), "
          f"h100-pcie5 profile, {len(baselines())} systems x residencies {list(RESIDENCIES)}", file=sys.stderr)
    rows = []
    for row in run_sweep(cfg, baselines(), RESIDENCIES, workload=workload, progress=progress):
        rows.append(row)
        print(f"  {row['system']:>26} r={row['residency']:.2f} hit={row['hit_rate']:.3f}", file=sys.stderr)
    out = Path(out_dir)
    write_jsonl(rows, out / "results.jsonl")
    plots = plot_results(rows, out, caption=f"seqmoe demo --tokens {num_tokens}")
    print(format_table(rows))
    print(f"wrote {out / 'results.jsonl'} and {', '.join(str(p) for p in plots)}")
    keep = ("system", "residency", "hit_rate", "ready_rate", "late_rate", "miss_rate", "full_load_fraction", "bound_fraction")
    print(json.dumps({"results": str(out / "results.jsonl"), "rows": [{k: r[k] for k in keep} for r in rows]}))
    return rows

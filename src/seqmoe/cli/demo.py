"""`seqmoe demo`: every system at three residencies on the embedded seqmoe-tiny workload.

The workload is real routing of our own trained MoE model (seqmoe-tiny, shipped in the package)
over Python standard library source: its train part (files the model trained on) trains the
forecaster and the baselines' statistics, its test part (held-out files) is replayed
(`seqmoe.arch.tiny.traces`). The demo trains the seq2seq forecaster once (about 15 seconds; kept in
`$SEQMOE_CACHE`), then compares the baselines, the oracles and `seqmoe` with the `seqmoe-tiny` model
profile on the default hardware profile. No downloads, no `../shared`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from seqmoe.arch.tiny.traces import load_demo_traces
from seqmoe.base.errors import UserError, needs_extra
from seqmoe.brain.manager.systems import systems_with
from seqmoe.brain.predict.checkpoints import cache_dir, trace_fingerprint
from seqmoe.config import COMPARED_RESIDENCIES, DEFAULT_HARDWARE, SimConfig
from seqmoe.sim.report.plot import plot_results
from seqmoe.sim.report.table import format_table, write_jsonl
from seqmoe.sim.run import load_workload, run_sweep
from seqmoe.trace.schema import RoutingTrace

FORECASTER = dict(epochs=6, hash_buckets=4096, embed_dim=128, hidden_dim=128, query_dim=128, threads=1)
"""The demo's forecaster: smaller than the default (about 15 s of training on one thread, which also
makes it the same on every machine with the same torch build); the time cap is only a safeguard."""


def demo_predictor(train: RoutingTrace, *, minutes: float = 2.5, progress: bool = False) -> Path:
    """The demo forecaster's folder, trained on `train` (for at most `minutes`) once and cached."""
    out = cache_dir() / "predictors" / f"demo-{trace_fingerprint(train)}-{minutes:g}min"
    if not (out / "model.safetensors").is_file():
        try:
            from seqmoe.brain.predict.train import train_seq_predictor  # torch: only when this runs
        except ImportError:
            raise needs_extra("the demo trains a forecaster, which needs torch", "train") from None
        print(f"seqmoe demo: training the forecaster once into {out} (at most {minutes:g} minutes)", file=sys.stderr)
        train_seq_predictor(train, out, progress=progress, max_minutes=minutes, **FORECASTER)
    return out


def run_demo(*, num_tokens: int = 3000, out_dir: str | Path = "results/demo", forecaster_minutes: float = 2.5,
             progress: bool = False, json_line: bool = False) -> list[dict]:
    """Train (once) and replay every system; print a table (and with `json_line` a JSON line), write JSONL and plots."""
    if num_tokens < 50:
        raise UserError(f"--tokens must be at least 50, got {num_tokens}")
    if not forecaster_minutes > 0:
        raise UserError(f"--forecaster-minutes must be positive, got {forecaster_minutes}")
    train, test = load_demo_traces()
    predictor = demo_predictor(train, minutes=forecaster_minutes, progress=progress)
    cfg = SimConfig(trace="embedded:seqmoe-tiny-test", train="embedded:seqmoe-tiny-train", model_profile="seqmoe-tiny",
                    hardware=DEFAULT_HARDWARE, predictor=str(predictor), max_tokens=num_tokens)
    workload = load_workload(cfg, train=train, test=test)
    systems = systems_with("baseline", "oracle", "seqmoe")
    print(f"seqmoe demo: {workload.test.num_tokens} tokens of seqmoe-tiny routing over held-out stdlib files "
          f"({workload.test.num_requests} requests), {DEFAULT_HARDWARE} profile, {len(systems)} systems x residencies "
          f"{list(COMPARED_RESIDENCIES)}", file=sys.stderr)
    rows = []
    for row in run_sweep(cfg, systems, COMPARED_RESIDENCIES, workload=workload, progress=progress):
        rows.append(row)
        print(f"  {row['system']:>26} r={row['residency']:.2f} hit={row['hit_rate']:.3f} "
              f"bound={row['bound_fraction']:.3f}", file=sys.stderr)
    out = Path(out_dir)
    write_jsonl(rows, out / "results.jsonl")
    plots = plot_results(rows, out, caption=f"seqmoe demo --tokens {num_tokens}")
    print(format_table(rows))
    print(f"wrote {out / 'results.jsonl'} and {', '.join(str(p) for p in plots)}")
    keep = ("system", "residency", "hit_rate", "ready_rate", "late_rate", "miss_rate", "full_load_fraction", "bound_fraction")
    if json_line:
        print(json.dumps({"results": str(out / "results.jsonl"), "rows": [{k: r[k] for k in keep} for r in rows]}))
    return rows

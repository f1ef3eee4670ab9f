"""Fit synthetic-trace statistics on the DeepSeek-V2-Lite Puffin traces and write them into the package.

    .venv/bin/python benchmarks/fit_synthetic.py \
        [--traces ../shared/data/traces/deepseek-v2-lite-puffin/puffin] \
        [--out src/seqmoe/data/synthetic_deepseek-v2-lite.json]

Only derived statistics are written (popularity, successor tables, weights, length distribution);
the traces themselves never enter the repository. Prints per layer the source's statistics and
those of a generated trace of 20k tokens (source / generated), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from seqmoe._files import atomic_path
from seqmoe.trace import stats
from seqmoe.trace.importers import import_moe_beyond_csv
from seqmoe.trace.schema import RoutingTrace
from seqmoe.trace.synthetic import DEFAULT_PARAMS_FILE, fit_synthetic_params, generate_trace, \
    positions_in_request, reuse_per_layer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = REPO.parent / "shared/data/traces/deepseek-v2-lite-puffin/puffin"


def _stats(trace: RoutingTrace, window: int) -> dict[str, np.ndarray]:
    """Per-layer statistics; affinity is [L] with layer 0 set to NaN (it scores layer l-1 -> l)."""
    return {
        "reuse": stats.token_reuse_by_layer(trace),
        "window": reuse_per_layer(trace.expert_ids, positions_in_request(trace.request_offsets), window),
        "affinity": np.concatenate([[np.nan], stats.layer_affinity_by_layer(trace)]),
        "top10_share": stats.popularity_skew(trace).top_share,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="folder of prompt_*_data.csv files")
    ap.add_argument("--out", type=Path, default=REPO / "src/seqmoe/data" / DEFAULT_PARAMS_FILE, help="params JSON")
    ap.add_argument("--num-successors", type=int, default=8, help="successors kept per expert")
    ap.add_argument("--successor-weight", type=float, default=0.5, help="beta (fixed, see trace/synthetic.py)")
    ap.add_argument("--seed", type=int, default=0, help="seed of calibration and of the check trace")
    args = ap.parse_args()

    t0 = time.perf_counter()
    trace = import_moe_beyond_csv(args.traces, progress=False)
    t_load = time.perf_counter() - t0
    params = fit_synthetic_params(trace, num_successors=args.num_successors,
                                  successor_weight=args.successor_weight, seed=args.seed)
    t_fit = time.perf_counter() - t0 - t_load
    text = json.dumps(params.to_dict(), separators=(",", ":"))
    with atomic_path(args.out) as tmp:
        Path(tmp).write_text(text + "\n")

    t1 = time.perf_counter()
    gen = generate_trace(params, num_tokens=20_000, seed=args.seed + 1)
    t_gen = time.perf_counter() - t1
    real, syn = _stats(trace, params.window), _stats(gen, params.window)
    keys = list(real)
    print(f"{'layer':>5} | " + " | ".join(f"{k:>13}" for k in keys) + f" | {'a':>5} {'b':>5}")
    for l in range(trace.num_layers):
        cols = " | ".join(f"{real[k][l]:6.3f}/{syn[k][l]:6.3f}" for k in keys)
        print(f"{l:>5} | {cols} | {params.reuse_weight[l]:5.2f} {params.window_weight[l]:5.2f}")
    summary = {"source_tokens": trace.num_tokens, "source_requests": trace.num_requests,
               "random_reuse": round(trace.top_k / trace.num_experts, 4)}
    for k in keys:
        summary[f"{k}_real"] = round(float(np.nanmean(real[k])), 4)
        summary[f"{k}_generated"] = round(float(np.nanmean(syn[k])), 4)
    summary["reuse_max_layer_gap"] = round(float(np.max(np.abs(real["reuse"] - syn["reuse"]))), 4)
    summary.update({"mean_request_len_real": round(trace.num_tokens / trace.num_requests, 1),
                    "json_bytes": len(text), "load_s": round(t_load, 1), "fit_s": round(t_fit, 1),
                    "generate_20k_s": round(t_gen, 2), "out": str(args.out)})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

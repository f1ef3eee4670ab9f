"""The online forecaster live on the CPU: seqmoe from a cold start against LRU, and what the learner
costs the decode step.

    python benchmarks/online_live.py [--new-tokens 128] [--out results/online_live.json]

`seqmoe bench-runtime`'s harness (`seqmoe.runtime.timing.decode.bench_runtime`: seqmoe-tiny, its built-in
prompts, greedy decode over the emulated link, one torch thread) with no training trace and no
forecaster (`online=True`):
1. cold: `on-demand-lru` and `seqmoe` each from an empty pool and an empty cache;
2. the learner's cost: `seqmoe` started from the same cached forecaster (learned by a warm-up run),
   once learning on and once paused (`OffloadConfig.learn=False`); the tokens/s of the two differ by
   what the learner's process takes from the decode step (and by the decisions the new rounds change).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from seqmoe.runtime.timing.decode import bench_runtime, format_table
from seqmoe.arch.collect import load_model
from seqmoe.config import OffloadConfig

RESIDENCIES = (0.25, 0.45)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", help="also write the results to this JSON file")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("seqmoe-tiny", device="cpu", dtype="float32")
    run = lambda **kw: bench_runtime(model, tok, residencies=RESIDENCIES, new_tokens=args.new_tokens, repeats=2,  # noqa: E731
                                     online=True, log=lambda line: print(line, file=sys.stderr), **kw)
    out = {"cold": run(systems=("on-demand-lru", "seqmoe"))}
    with tempfile.TemporaryDirectory() as cache:
        run(systems=("seqmoe",), cache=cache)  # warm-up: the cache then holds a forecaster
        out["paused"] = run(systems=("seqmoe",), cache=cache, config=OffloadConfig(learn=False))
        out["learning"] = run(systems=("seqmoe",), cache=cache)
    for name, res in out.items():
        print(f"== {name}")
        print(format_table(res))
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Resident memory of `seqmoe serve`'s batcher over many requests: it must level off, not grow per request.

    python benchmarks/serve_memory.py --system on-demand-lru --bursts 8
    python benchmarks/serve_memory.py --system seqmoe --control thread --json out.json

seqmoe-tiny is loaded as `seqmoe serve` loads it (`start_batcher`, on the CPU) and serves bursts of ten
requests (greedy and seeded sampling, 30 tokens each) through its batcher thread, without HTTP. After two
warm-up bursts the process's RSS is printed after each burst, then the growth over the measured ones, the
growth per request over their second half, and the Python allocations that grew most (tracemalloc). The
forecaster of the `seqmoe` systems is trained for a few seconds on the packaged seqmoe-tiny trace (its
quality does not matter here).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import tracemalloc
from pathlib import Path


def _burst(served, prompts: list[list[int]], max_tokens: int) -> None:
    from seqmoe.serve.batcher import GenParams, Job

    for i, ids in enumerate(prompts):
        done, failed = threading.Event(), []

        def emit(kind, *rest):
            if kind == "error":
                failed.append(rest)
            if kind in ("done", "error"):
                done.set()

        params = GenParams(max_tokens=max_tokens, temperature=0.8 if i % 2 else 0.0, seed=i)
        served.batcher.submit(Job(prompt_ids=ids, params=params, emit=emit))
        if not done.wait(120) or failed:
            raise SystemExit(f"request {i} did not finish: {failed or 'timed out'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", default="on-demand-lru", help="live system (default: on-demand-lru)")
    p.add_argument("--control", choices=["inline", "thread"], default=None,
                   help="control plane (default: the device's)")
    p.add_argument("--residency", type=float, default=0.3, help="resident fraction of the experts (default: 0.3)")
    p.add_argument("--bursts", type=int, default=6, help="measured bursts of ten requests (default: 6)")
    p.add_argument("--max-tokens", type=int, default=30, help="tokens per request (default: 30)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.bursts < 2:
        p.error("--bursts must be at least 2")

    from seqmoe.brain.manager import system_spec
    from seqmoe.serve.api import rss_bytes
    from seqmoe.config import LoadConfig, OffloadConfig
    from seqmoe.serve.startup import start_batcher
    from seqmoe.arch.tiny.traces import TRAIN_FILE

    train = str(TRAIN_FILE)
    with tempfile.TemporaryDirectory() as tmp:
        predictor = None
        if system_spec(args.system).needs_predictor:
            from seqmoe.brain.predict.train import train_seq_predictor
            from seqmoe.trace.io import load_trace

            predictor = str(Path(tmp) / "predictor")
            train_seq_predictor(load_trace(train), predictor, epochs=1, max_minutes=0.1, progress=False)
        served = start_batcher(LoadConfig(model="seqmoe-tiny", threads=1),
                             OffloadConfig(residency=args.residency, system=args.system, device="cpu", train=train,
                                           predictor=predictor, control=args.control))
        try:
            prompts = [served.tokenizer(f"def parse_{i}(text):")["input_ids"] for i in range(10)]
            for _ in range(2):
                _burst(served, prompts, args.max_tokens)
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            rss = [rss_bytes()]
            for b in range(args.bursts):
                _burst(served, prompts, args.max_tokens)
                gc.collect()
                rss.append(rss_bytes())
                print(f"burst {b + 1}: RSS {rss[-1] / 2**20:.1f} MiB", file=sys.stderr)
            grew = tracemalloc.take_snapshot().compare_to(before, "lineno")[:5]
        finally:
            served.close()
    # A leak grows in the second half too; the allocator's last steps after the warm-up come in the first.
    half = len(rss) // 2
    late = 10 * (len(rss) - 1 - half)
    out = {"system": args.system, "control": args.control, "requests": 10 * args.bursts,
           "rss_mib": [r / 2**20 for r in rss], "grown_mib": (rss[-1] - rss[0]) / 2**20,
           "second_half_kb_per_request": (rss[-1] - rss[half]) / 1e3 / late}
    print(f"{args.system} [{args.control or 'default'} control]: RSS {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB "
          f"over {out['requests']} requests; {out['second_half_kb_per_request']:.1f} KB per request over the "
          f"last {late}")
    print("Python allocations that grew most:")
    for st in grew:
        print(f"  {st.size_diff / 1e3:+9.1f} KB  {st.traceback[0]}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

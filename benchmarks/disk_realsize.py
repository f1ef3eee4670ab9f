"""DeepSeek-V2-Lite at real size streamed from disk on this machine: a 31 GB bf16 checkpoint with seeded
weights, a host cache smaller than its experts, routers forced to the real Puffin routing.

    python benchmarks/disk_realsize.py --checkpoint /work/ckpt/ds-v2-lite-bf16 --write   # writes it once (31 GB)
    python benchmarks/disk_realsize.py --checkpoint DIR --host-memory 8GiB --residency 0.1 --tokens 60
    python benchmarks/disk_realsize.py --checkpoint DIR --tokens 150 --predictor FC   # FC: seqmoe train on the split

Measures this machine's cost model first (full-load time per token, one expert's copy and disk
read), then each system's measured time per token next to the simulator's for the same budgets, the
bytes read from disk per token and the peak resident memory (`seqmoe.runtime.timing.disk`). Prints a table;
--out writes the JSON lines (setup first) whole at the end. Skips cleanly without ../shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from puffin_split import add_shared_flag, puffin_split  # noqa: E402


def _requests(trace, tokens: int, max_len: int):
    """Whole requests of 2..max_len tokens in file order until `tokens` in all (the first warms up)."""
    off, keep, total = trace.request_offsets, [], 0
    for r in range(trace.num_requests):
        n = int(off[r + 1] - off[r])
        if 2 <= n <= max_len:
            keep.append(r)
            total += n
            if total >= tokens and len(keep) >= 2:
                break
    return trace.select_requests(keep)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="the checkpoint folder (written with --write when missing)")
    p.add_argument("--write", action="store_true", help="write the checkpoint first when the folder does not exist")
    p.add_argument("--systems", default="on-demand-lru,seqmoe")
    p.add_argument("--residency", type=float, default=0.1, help="device pool, a fraction of the experts (default 0.1)")
    p.add_argument("--host-memory", default="8GiB", help="host cache for the experts (default 8GiB)")
    p.add_argument("--tokens", type=int, default=60, help="positions replayed, whole requests (the first warms up)")
    p.add_argument("--max-request", type=int, default=40, help="longest request replayed, in tokens")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of torch")
    p.add_argument("--predictor", metavar="DIR", help="a trained forecaster (seqmoe train) for the seqmoe systems "
                   "(default: they learn online)")
    p.add_argument("--out", help="JSON lines file")
    add_shared_flag(p)
    args = p.parse_args(argv)
    split = puffin_split(args.shared)
    if split is None:
        return 0
    import torch

    from seqmoe.runtime.timing.checkpoint import write_checkpoint
    from seqmoe.runtime.timing.disk import disk_replay_bench
    from seqmoe.base.errors import UserError

    torch.set_num_threads(args.threads)
    try:
        folder = Path(args.checkpoint)
        if not folder.exists():
            if not args.write:
                raise UserError(f"no checkpoint at {folder}: pass --write to write it (31 GB)")
            write_checkpoint("deepseek-v2-lite", folder, dtype=torch.bfloat16)
        train, test = split
        replay = _requests(test, args.tokens, args.max_request)
        result = disk_replay_bench(folder, replay, train=train, systems=tuple(args.systems.split(",")),
                                   residency=args.residency, host_memory=args.host_memory, predictor=args.predictor,
                                   log=lambda line: print(line, file=sys.stderr, flush=True))
    except UserError as e:
        print(f"disk_realsize: error: {e}", file=sys.stderr)
        return 2
    head = (f"{'system':<16} {'ms/token':>9} {'sim ms':>8} {'sim/meas':>8} {'disk MiB/tok':>12} {'sim MiB/tok':>11} "
            f"{'host hit':>8} {'peak RSS GiB':>12}")
    print(f"full load {result['full_ms_per_token']:.1f} ms/token; expert copy {result['copy_ms']:.2f} ms, "
          f"disk read {result['disk_read_ms']:.2f} ms")
    print(head + "\n" + "-" * len(head))
    for r in result["runs"]:
        print(f"{r['system']:<16} {r['ms_per_token']:>9.1f} {r['sim_ms_per_token']:>8.1f} {r['sim_over_measured']:>8.2f} "
              f"{r['disk_bytes_per_token'] / 2**20:>12.1f} {r['sim_disk_bytes_per_token'] / 2**20:>11.1f} "
              f"{r['host_hit_rate']:>8.3f} {(r['peak_rss_bytes'] or 0) / 2**30:>12.2f}")
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"setup": {k: v for k, v in result.items() if k != "runs"}}) + "\n")
            for row in result["runs"]:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

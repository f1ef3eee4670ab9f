"""Real-size runs: DeepSeek-V2-Lite or Mixtral-8x7B shapes with random weights, routers forced to a
real trace, decoded at full load and offloaded; measured time per token next to the simulator's.

    python benchmarks/realsize.py --arch deepseek-v2-lite --trace results/ds/test.safetensors \
        --train results/ds/train.safetensors --predictor results/ds/predictor --device cuda
    python benchmarks/realsize.py --arch deepseek-v2-lite ... --width-divisor 16 --tokens 150   # CPU version

Prints a table and writes one JSON object per run (and one for the setup) to --out.
See `seqmoe.runtime.timing.replay` for what is timed and how the cost model is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from seqmoe.config import COMPARED_RESIDENCIES
from seqmoe.brain.manager.miss_paths import MISS_PATHS

DEFAULT_SYSTEMS = "on-demand-lru,seqmoe,moe-infinity-style,belady,oracle-prefetch"


def _replay(trace, tokens: int, min_len: int, max_len: int):
    """Whole requests of `trace` with min_len..max_len tokens, in file order, until `tokens` in all."""
    off = trace.request_offsets
    keep, total = [], 0
    for r in range(trace.num_requests):
        n = int(off[r + 1] - off[r])
        if min_len <= n <= max_len:
            keep.append(r)
            total += n
            if total >= tokens:
                break
    return trace.select_requests(keep)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="deepseek-v2-lite", help="deepseek-v2-lite or mixtral-8x7b")
    p.add_argument("--trace", required=True, help="routing to replay (a saved trace or an importable folder/files)")
    p.add_argument("--train", help="training split of the same model's routing (start placement, statistics); "
                   "default: --test-requests of --trace are replayed, the rest is the training split")
    p.add_argument("--test-requests", type=int, default=2, help="without --train: requests replayed (default 2)")
    p.add_argument("--predictor", help="forecaster checkpoint of the seqmoe systems (seqmoe train on --train)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated (default {DEFAULT_SYSTEMS})")
    p.add_argument("--residencies", default=",".join(map(str, COMPARED_RESIDENCIES)))
    p.add_argument("--tokens", type=int, default=1000, help="positions replayed (whole requests; the first warms up)")
    p.add_argument("--max-request", type=int, default=400, help="longest request replayed, in tokens")
    p.add_argument("--layers", type=int, help="keep the first N decoder layers (host memory; default all)")
    p.add_argument("--width-divisor", type=int, default=1, help="divide hidden sizes by this (CPU version)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--link-ratio", type=float, default=1.0, help="CPU: one copy = this x one layer's expert compute")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of torch")
    p.add_argument("--miss", choices=MISS_PATHS, default="copy", help="how misses are served: copy (default, as the real-size numbers "
                   "were first taken), in-place, cpu or auto")
    p.add_argument("--control", choices=("inline", "thread"), default=None, help="the runtime's control plane "
                   "(default: the device's; on CUDA inline decodes eagerly, thread runs the captured step)")
    p.add_argument("--out", help="JSON lines file (written whole at the end)")
    args = p.parse_args(argv)

    import torch

    from seqmoe.base.errors import UserError
    from seqmoe.brain.manager.systems import SYSTEMS
    from seqmoe.arch.published import build_model
    from seqmoe.runtime.timing.forced import layers_of
    from seqmoe.runtime.timing.replay import format_rows, replay_bench
    from seqmoe.trace.io import load_trace
    from seqmoe.trace.split import split_trace

    torch.set_num_threads(args.threads)
    try:
        systems = [s for s in args.systems.split(",") if s]
        if not args.predictor:
            dropped = [s for s in systems if s in SYSTEMS and SYSTEMS[s].needs_predictor]
            systems = [s for s in systems if s not in dropped]
            if dropped:
                print(f"no --predictor: leaving out {', '.join(dropped)}", file=sys.stderr)
        residencies = tuple(float(r) for r in args.residencies.split(","))
        trace = load_trace(args.trace)
        if args.train:
            train = load_trace(args.train)
        else:
            train, trace = split_trace(trace, num_test=args.test_requests)
        replay = _replay(trace, args.tokens, 2, args.max_request)
        if args.layers is not None:
            replay = layers_of(replay, args.layers)
            train = layers_of(train, args.layers)
        cuda = args.device.startswith("cuda")
        # At reduced width, a vocabulary just large enough for the replayed token ids (a small lm_head).
        small = args.width_divisor > 1 and replay.token_ids is not None
        vocab = int(replay.token_ids.max()) + 1 if small else None
        model = build_model(args.arch, width_divisor=args.width_divisor, num_layers=args.layers, vocab_size=vocab,
                            device=args.device, dtype=torch.bfloat16 if cuda else torch.float32)
        print(f"{args.arch}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, replaying "
              f"{replay.num_requests} requests ({replay.num_tokens} tokens)", file=sys.stderr)
        result = replay_bench(model, replay, train=train, predictor=args.predictor, systems=systems,
                              residencies=residencies, link_ratio=args.link_ratio, miss=args.miss,
                              control=args.control,
                              log=lambda line: print(line, file=sys.stderr, flush=True))
    except UserError as e:
        print(f"realsize: error: {e}", file=sys.stderr)
        return 2
    result["arch"], result["width_divisor"], result["trace"] = args.arch, args.width_divisor, args.trace
    print(format_rows(result))
    if args.out:
        setup = {k: v for k, v in result.items() if k != "runs"}
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"setup": setup}) + "\n")
            for row in result["runs"]:
                f.write(json.dumps({**row, "arch": args.arch}) + "\n")
        os.replace(tmp, args.out)  # no half-written file
    return 0


if __name__ == "__main__":
    sys.exit(main())

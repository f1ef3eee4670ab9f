"""`seqmoe generate` and `seqmoe bench-runtime`: the routed experts offloaded to a C-slot device pool.

    seqmoe generate --model seqmoe-tiny --prompt "Once upon a time" --residency 0.3 --system on-demand-lru
    seqmoe generate --model models/olmoe --prompt "..." --residency 0.5 --system seqmoe \\
        --train results/olmoe/train.safetensors --predictor results/predictor-olmoe --max-new-tokens 64 --json
    seqmoe bench-runtime --model seqmoe-tiny --residencies 0.25,0.5,1.0 --out bench.jsonl

The model is loaded on the CPU and then offloaded: its routed experts are packed into host memory
and only the dense rest moves to `--device`, so the whole model never has to fit there.
`add_runtime_commands(subparsers)` registers the command on the main parser (src/seqmoe/cli.py);
it sets `func(args) -> int`. Bad input raises `UserError`. Torch is imported only when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from seqmoe.config import (
    COMPARED_SYSTEMS, DEFAULT_HARDWARE, DEFAULT_RUNTIME_MISS, DEFAULT_RUNTIME_RESIDENCY, DEFAULT_SYSTEM, ROUTINGS,
)
from seqmoe.errors import UserError
from seqmoe.manager.miss_paths import MISS_PATHS


def add_offload_flags(p: argparse.ArgumentParser) -> None:
    """The flags `generate` and `serve` share: the model, how it is offloaded, torch's threads."""
    p.add_argument("--model", required=True, metavar="PATH_OR_NAME", help="model folder with config.json, or seqmoe-tiny")
    p.add_argument("--residency", type=float, default=DEFAULT_RUNTIME_RESIDENCY,
                   help=f"fraction of experts in device slots (default: {DEFAULT_RUNTIME_RESIDENCY})")
    p.add_argument("--system", default=DEFAULT_SYSTEM, help=f"memory-management system (default: {DEFAULT_SYSTEM})")
    p.add_argument("--train", metavar="TRACE", help="routing trace of this model (start placement; needed by "
                   "systems that learn, e.g. affinity-style)")
    p.add_argument("--predictor", metavar="DIR", help="forecaster checkpoint of the seqmoe systems (default: one "
                   "trained on --train once and cached)")
    p.add_argument("--device", default=None, help="device of the pool and the dense layers (default: cuda when "
                   "available, else cpu)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights dtype (default: auto, the checkpoint's)")
    p.add_argument("--control", choices=("inline", "thread"), default=None,
                   help="where the control plane runs: in the router hooks (inline, synchronises each layer) or on "
                   "its own thread fed by a routing mailbox (default: thread on cuda, inline on cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_miss_flag(p)


def add_miss_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--miss", choices=MISS_PATHS, default=None, help="how a missed expert is served: copy into a "
                   "slot, in-place (read from host memory), cpu (computed on the host CPU; with --control thread or "
                   "--graph on CUDA it needs triton) or auto "
                   "(chosen per miss from the cost model's link and host CPU, measured at start by default); default: "
                   f"{DEFAULT_RUNTIME_MISS} with inline control, copy with --control thread or --graph")


def add_runtime_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `generate` to the main parser's subparsers."""
    gen = subparsers.add_parser(
        "generate",
        help="greedy generation with experts offloaded to a pool of device slots",
        description="Load a MoE causal LM, offload its routed experts (C = floor(R x L x E) device slots managed "
        "by --system), generate greedily from --prompt and print the text, tokens/s, hit rate and memory.",
    )
    add_offload_flags(gen)
    gen.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    gen.add_argument("--bandwidth", type=float, default=None, help="host->device bytes/s of the cost model")
    gen.add_argument("--hardware", default=None, help="hardware profile of the cost model (a preset or file), or "
                     f"measured: {DEFAULT_HARDWARE} with this machine's link and host CPU measured at start (default: "
                     f"measured with --miss cpu or auto, else {DEFAULT_HARDWARE})")
    gen.add_argument("--graph", action="store_true", help="decode with DecodeGraph: a static cache and, on cuda, the "
                     "decode step captured once as a CUDA graph (implies --control thread)")
    gen.add_argument("--routing", choices=ROUTINGS, default="exact", help="exact (default), or cache-aware: a missing "
                     "routed expert may be swapped for a resident one the router scored close to it, within --max-kl")
    gen.add_argument("--max-kl", type=float, default=None, metavar="NATS", help="cache-aware routing's budget per token: "
                     "KL divergence from the router's distribution (0.01-0.02 cost seqmoe-tiny under 0.5%% perplexity)")
    gen.add_argument("--json", action="store_true", help="print the run's stats as one JSON object on the last line")
    gen.set_defaults(func=run_generate)

    b = subparsers.add_parser(
        "bench-runtime",
        help="tokens/s of greedy decode: full model vs offloaded systems and residencies (CPU)",
        description="Decode built-in Python snippets (or --prompt) greedily with the full model and with each "
        "--systems x --residencies offloaded on the CPU over an emulated link on which every expert row that crosses "
        "it (a copy, or a missed row read in place) takes --link-ratio x one layer's measured expert compute; print tokens/s, hit rate and the host overhead "
        "per token, then one JSON line.",
    )
    b.add_argument("--model", default="seqmoe-tiny", metavar="PATH_OR_NAME", help="model folder or seqmoe-tiny (default)")
    b.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; default: built-in snippets)")
    b.add_argument("--residencies", default="0.25,0.5,1.0", help="comma-separated residencies (default: 0.25,0.5,1.0)")
    b.add_argument("--systems", default=",".join(COMPARED_SYSTEMS),
                   help=f"comma-separated systems (default: {','.join(COMPARED_SYSTEMS)})")
    b.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default: 32)")
    b.add_argument("--repeats", type=int, default=2, help="passes over the prompts per run; the fastest counts (default: 2)")
    b.add_argument("--train", metavar="TRACE", help="routing trace of the model (default: collected over built-in prompts)")
    b.add_argument("--predictor", metavar="DIR", help="forecaster checkpoint for the seqmoe systems (default: one "
                   "trained briefly on the trace)")
    b.add_argument("--predictor-minutes", type=float, default=0.5, help="training time of that forecaster (default: 0.5)")
    b.add_argument("--link-ratio", type=float, default=1.0, help="one expert copy takes this many times one layer's "
                   "expert compute (default: 1)")
    b.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto", help="weights dtype")
    b.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    b.add_argument("--out", metavar="FILE.jsonl", help="also append the JSON line to this file")
    b.add_argument("--control", choices=("inline", "thread"), default=None, help="where the control plane runs: in "
                   "the router hooks (inline, the default) or on its own thread fed by the routing mailbox")
    add_miss_flag(b)
    b.set_defaults(func=run_bench)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run_generate(args) -> int:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from seqmoe.collect import load_model
    from seqmoe.predict.checkpoints import seq_predictor_for
    from seqmoe.manager import system_spec
    from seqmoe.runtime import offload
    from seqmoe.trace.io import load_trace

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    train = load_trace(args.train) if args.train else None
    predictor = args.predictor
    if system_spec(args.system).needs_predictor:
        if train is None:
            raise UserError(f"--system {args.system} needs --train TRACE (and --predictor DIR, or one is trained on it)")
        predictor = seq_predictor_for(args.predictor, train)
    model, tok = load_model(args.model, device="cpu", dtype=args.dtype)
    if tok is None:
        raise UserError(f"{args.model} has no tokenizer files; generate needs a tokenizer to read --prompt")
    ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise UserError("the prompt has no tokens; give some text")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.graph and args.control == "inline":
        raise UserError("--graph needs --control thread")
    runtime = offload(model, args.residency, args.system, device=device, train=train, predictor=predictor,
                      bandwidth=args.bandwidth, hardware=args.hardware, control="thread" if args.graph else args.control,
                      routing=args.routing, max_kl=args.max_kl, miss=args.miss)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else tok.eos_token_id
    ids = ids.to(runtime.pool.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        if args.graph:
            from seqmoe.runtime.posted.graph import DecodeGraph

            out = DecodeGraph(runtime, ids.shape[1] + args.max_new_tokens).generate(
                ids, args.max_new_tokens, eos_token_id=tok.eos_token_id)
        else:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, num_beams=1, pad_token_id=pad)
    if runtime.pool.device.type == "cuda":
        torch.cuda.synchronize(runtime.pool.device)
    wall = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    text = tok.decode(new, skip_special_tokens=True)
    stats = runtime.stats()
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    stats.update(generated_tokens=int(new.numel()), wall_s=wall, wall_tokens_per_s=new.numel() / wall,
                 dense_bytes=dense, model=str(args.model))
    runtime.close()
    print(args.prompt + text)
    print(f"\n{new.numel()} tokens in {wall:.2f} s ({new.numel() / wall:.1f} tokens/s) on {stats['device']}, "
          f"system {args.system}, residency {args.residency} ({stats['capacity']} of "
          f"{stats['num_layers'] * stats['num_experts']} experts in device slots)")
    print(f"hit rate {stats['hit_rate']:.3f} (ready {stats['ready']}, late {stats['late']}, misses {stats['misses']}: "
          f"--miss {stats['miss']}, {stats['misses_cpu']} on the host CPU, {stats['misses_in_place']} read in place); "
          f"{stats['copies']} expert copies ({_mib(stats['bytes_copied'])})")
    print(f"memory: experts on device {_mib(stats['device_expert_bytes'])}, on host {_mib(stats['host_expert_bytes'])}; "
          f"dense layers {_mib(dense)}")
    host = stats["host_expert_s"]
    print(f"cost model: {runtime.hardware.name}: {1e6 * stats['copy_time_s']:.1f} us per expert copy"
          + (f", {1e6 * host:.1f} us per expert on the host CPU" if host is not None else ""))
    if args.json:
        print(json.dumps(stats))
    return 0


def _floats(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not out:
        raise UserError(f"{what} is empty")
    return out


def run_bench(args) -> int:
    """`seqmoe bench-runtime`: the table, then one JSON line (also appended to --out)."""
    residencies = _floats(args.residencies, "--residencies")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems:
        raise UserError("--systems is empty")
    from seqmoe.collect import load_model
    from seqmoe.bench.decode import PROMPTS, bench_runtime, format_table
    from seqmoe.trace.io import load_trace

    import torch

    torch.set_num_threads(args.threads)
    train = load_trace(args.train) if args.train else None
    model, tok = load_model(args.model, device="cpu", dtype=args.dtype)
    if tok is None:
        raise UserError(f"{args.model} has no tokenizer files; bench-runtime needs one to encode the prompts")
    log = lambda line: print(f"seqmoe: {line}", file=sys.stderr)  # noqa: E731
    result = bench_runtime(model, tok, args.prompt or PROMPTS, residencies=residencies, systems=systems,
                           new_tokens=args.new_tokens, repeats=args.repeats, train=train, predictor=args.predictor,
                           link_ratio=args.link_ratio, predictor_minutes=args.predictor_minutes, log=log,
                           miss=args.miss, control=args.control)
    result["model"] = str(args.model)
    print(format_table(result))
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0

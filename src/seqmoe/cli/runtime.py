"""`seqmoe generate`, `seqmoe convert` and `seqmoe bench-runtime`: the routed experts offloaded to a C-slot device pool.

    seqmoe generate --model seqmoe-tiny --prompt "Once upon a time" --residency 0.3 --system on-demand-lru
    seqmoe generate --model models/olmoe --prompt "..." --residency 0.5 --system seqmoe \\
        --train results/olmoe/train.safetensors --predictor results/predictor-olmoe --max-new-tokens 64 --json
    seqmoe bench-runtime --model seqmoe-tiny --residencies 0.25,0.45,0.65 --out bench.jsonl
    seqmoe convert models/olmoe models/olmoe-int4 --expert-dtype int4

The offload flags are generated from `LoadConfig` and `OffloadConfig` (`seqmoe.config`), which check
every value before anything loads; `seqmoe.runtime.load` loads and offloads the model (as `seqmoe
serve` does). `add_runtime_commands(subparsers)` registers the commands on the main parser
(src/seqmoe/cli/__init__.py); each sets `func(args) -> int`. Bad input raises `UserError`. Torch is
imported only when a command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from seqmoe.arch.model_dirs import max_positions, resolve_model_dir
from seqmoe.base.errors import UserError
from seqmoe.brain.manager.placement import check_residency
from seqmoe.brain.manager.systems import check_live_system
from seqmoe.cli.args import add_config_flags, config_from_args, floats, progress, prompt_lengths
from seqmoe.config import (
    COMPARED_RESIDENCIES,
    COMPARED_SYSTEMS,
    LoadConfig,
    OffloadConfig,
    check_bench,
)
from seqmoe.costs.precision import PRECISIONS, SHIPPED, format_bytes
from seqmoe.trace.io import load_trace


def add_offload_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = (), threads: int | None = None) -> None:
    """The flags of the commands that offload a model: `LoadConfig`'s and `OffloadConfig`'s (but `skip`)."""
    add_config_flags(p, LoadConfig, defaults={"threads": threads})
    add_config_flags(p, OffloadConfig, skip=skip)


def offload_configs(args, **overrides) -> tuple[LoadConfig, OffloadConfig]:
    """The command's checked configurations (UserError for a bad option, before anything loads)."""
    return config_from_args(LoadConfig, args), config_from_args(OffloadConfig, args, **overrides)


def add_runtime_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `generate` and `bench-runtime` to the main parser's subparsers."""
    gen = subparsers.add_parser(
        "generate",
        help="greedy generation with experts offloaded to a pool of device slots",
        description="Load a MoE causal LM, offload its routed experts (C = floor(R x L x E) device slots managed "
        "by --system), generate greedily from --prompt and print the text, tokens/s, hit rate and memory.",
    )
    add_offload_flags(gen)
    gen.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    gen.add_argument("--graph", action="store_true", help="decode with DecodeGraph: a static cache and, on cuda, the "
                     "decode step captured once as a CUDA graph (implies --control thread; the default on cuda where "
                     "the control plane runs on its thread)")
    gen.add_argument("--eager", action="store_true", help="decode with transformers' generate, each step run eagerly "
                     "(the default on the CPU)")
    gen.add_argument("--json", action="store_true", help="print the run's stats as one JSON object on the last line")
    gen.set_defaults(func=run_generate)

    c = subparsers.add_parser(
        "convert",
        help="write a checkpoint once with its routed experts quantized (int8, int4, fp8)",
        description="Read the safetensors checkpoint in SRC and write DST (a new folder): the dense tensors and "
        "other files unchanged, the routed experts in seqmoe's quantized rows (docs/DESIGN.md, 'Converted "
        "checkpoints'). seqmoe.load, generate and serve open DST and stream its bytes. DST appears whole or not at "
        "all.",
    )
    c.add_argument("src", metavar="SRC", help="the checkpoint folder (save_pretrained's, safetensors), or seqmoe-tiny")
    c.add_argument("dst", metavar="DST", help="the folder to write (must not exist)")
    c.add_argument("--expert-dtype", required=True, choices=PRECISIONS + tuple(SHIPPED), help="the routed experts' "
                   "precision: seqmoe's groups of 64, or a shipped format's layout (encoded by round to nearest)")
    c.add_argument("--requantize", action="store_true", help="convert a checkpoint shipped quantized (fp8 blocks, "
                   "mxfp4, gptq) too: its experts decoded, then rounded a second time (without this flag refused; "
                   "seqmoe loads such a checkpoint as it is)")
    c.add_argument("--json", action="store_true", help="print the byte counts as one JSON object")
    c.set_defaults(func=run_convert)

    b = subparsers.add_parser(
        "bench-runtime",
        help="tokens/s of greedy decode: full model vs offloaded systems and residencies (CPU)",
        description="Decode built-in Python snippets (or --prompt) greedily with the full model and with each "
        "--systems x --residencies offloaded on the CPU over an emulated link on which every expert row that crosses "
        "it (a copy, or a missed row read in place) takes --link-ratio x one layer's measured expert compute; print "
        "tokens/s, hit rate and the host overhead per token, then one JSON line.",
    )
    # One thread by default: decode timings that other load on the machine disturbs least.
    add_offload_flags(b, skip=("residency", "expert_memory", "system", "routing", "max_kl", "device", "hardware",
                               "bandwidth", "train", "predictor"), threads=1)
    b.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; default: built-in snippets)")
    residencies = ",".join(map(str, COMPARED_RESIDENCIES))
    b.add_argument("--residencies", default=residencies, help=f"comma-separated residencies (default: {residencies})")
    b.add_argument("--systems", default=",".join(COMPARED_SYSTEMS),
                   help=f"comma-separated systems (default: {','.join(COMPARED_SYSTEMS)})")
    b.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default: 32)")
    b.add_argument("--prompt-lengths", type=prompt_lengths, default=(512, 2048), metavar="N,N",
                   help="also time the first token of prompts this long (seeded ids; timing only, so they may exceed "
                   "the model's context), full load and offloaded; empty: skip (default: 512,2048)")
    b.add_argument("--repeats", type=int, default=2, help="passes over the prompts per run; the fastest counts (default: 2)")
    b.add_argument("--train", metavar="TRACE", help="routing trace of the model (default: collected over built-in prompts)")
    b.add_argument("--predictor", metavar="DIR", help="forecaster checkpoint for the seqmoe systems (default: one "
                   "trained briefly on the trace)")
    b.add_argument("--predictor-minutes", type=float, default=0.5, help="training time of that forecaster (default: 0.5)")
    b.add_argument("--link-ratio", type=float, default=1.0, help="one expert copy takes this many times one layer's "
                   "expert compute (default: 1)")
    b.add_argument("--online", action="store_true", help="a cold start: no training trace and no forecaster; every "
                   "pool starts empty and the seqmoe systems learn their forecaster online")
    b.add_argument("--out", metavar="FILE.jsonl", help="also append the JSON line to this file")
    b.set_defaults(func=run_bench)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run_convert(args) -> int:
    from seqmoe.runtime.disk.convert import convert  # torch: only when this runs

    report = convert(args.src, args.dst, args.expert_dtype, requantize=args.requantize, progress=progress(args))
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    else:
        ratio = report.expert_bytes_after / max(report.expert_bytes_before, 1)
        print(f"wrote {report.folder}: routed experts {_mib(report.expert_bytes_before)} -> "
              f"{_mib(report.expert_bytes_after)} at {report.precision} ({ratio:.2f}x), dense part "
              f"{_mib(report.dense_bytes)} unchanged")
    return 0


def run_generate(args) -> int:
    load, cfg = offload_configs(args)
    if args.graph and args.eager:
        raise UserError("--graph and --eager are two ways to decode: give one")
    cfg = cfg.for_graph() if args.graph else cfg
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt:
        raise UserError("--prompt is empty; give some text")
    limit = max_positions(resolve_model_dir(load.model))  # config.json's; a GGUF file's is checked once it loads
    if limit is not None and args.max_new_tokens >= limit:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the prompt in {load.model}'s "
                        f"context of {limit} positions; give at most {limit - 1}")
    import torch  # torch: only when this runs

    from seqmoe.runtime.load import load_offloaded  # torch: only when this runs

    loaded = load_offloaded(load, cfg, needs="generate needs a tokenizer to read --prompt", progress=progress(args))
    model, tok, runtime = loaded.model, loaded.tokenizer, loaded.runtime
    ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        runtime.close()  # the command ends here (restore cannot give back experts streamed from disk)
        raise UserError("the prompt has no tokens; give some text")
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit and ids.shape[1] + args.max_new_tokens > limit:
        runtime.close()
        raise UserError(f"the prompt has {ids.shape[1]} tokens and --max-new-tokens asks for {args.max_new_tokens} more, "
                        f"past {load.model}'s context of {limit} positions; give --max-new-tokens at most "
                        f"{max(limit - ids.shape[1], 0)} or a shorter prompt")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else tok.eos_token_id
    ids = ids.to(runtime.pool.device)
    # On CUDA the captured step is the default wherever the control plane runs on its thread.
    graph = args.graph or (not args.eager and runtime.pool.device.type == "cuda" and runtime.control == "thread")
    t0 = time.perf_counter()
    with torch.no_grad():
        if graph:
            from seqmoe.runtime.posted.graph import DecodeGraph  # torch: only when this runs

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
    stats.update(generated_tokens=int(new.numel()), decode="graph" if graph else "eager", wall_s=wall,
                 wall_tokens_per_s=new.numel() / wall, dense_bytes=dense, model=str(load.model))
    runtime.close()
    print(args.prompt + text)
    budget = f" (from --expert-memory {cfg.expert_memory})" if cfg.expert_memory is not None else ""
    print(f"\n{new.numel()} tokens in {wall:.2f} s ({new.numel() / wall:.1f} tokens/s, {stats['decode']} decode) on "
          f"{stats['device']}, system {cfg.system}, residency {stats['residency']:.4g}{budget}: {stats['capacity']} of "
          f"{stats['num_layers'] * stats['num_experts']} experts in device slots, {stats['expert_dtype']} experts of "
          f"{format_bytes(stats['expert_bytes'])}")
    print(f"hit rate {stats['hit_rate']:.3f} (ready {stats['ready']}, late {stats['late']}, misses {stats['misses']}: "
          f"--miss {stats['miss']}, {stats['misses_cpu']} on the host CPU, {stats['misses_in_place']} read in place"
          + (f", {stats['misses_twin']} from {stats['twin']} twins" if stats["twin"] else "") + "); "
          f"{stats['copies']} expert copies ({_mib(stats['bytes_copied'])})")
    twins = f" (twins {_mib(stats['host_twin_bytes'])})" if stats["twin"] else ""
    print(f"memory: experts on device {_mib(stats['device_expert_bytes'])}, on host {_mib(stats['host_expert_bytes'])}{twins}; "
          f"dense layers {_mib(dense)}")
    if "disk_reads" in stats:
        print(f"disk: a host cache of {stats['host_rows']} experts (host residency "
              f"{stats['host_rows'] / (stats['num_layers'] * stats['num_experts']):.3g}, {stats['host_policy']}), hit rate "
              f"{stats['host_hit_rate']:.3f}; {stats['disk_reads']} experts read ({_mib(stats['disk_bytes'])}, "
              f"{_mib(stats['disk_bytes_per_token'])} per token)")
    host = stats["sim_host_expert_s"]
    print(f"cost model: {runtime.hardware.name}: {1e6 * stats['sim_copy_time_s']:.1f} us per expert copy"
          + (f", {1e6 * host:.1f} us per expert on the host CPU" if host is not None else ""))
    fc = stats["forecaster"]
    if fc is not None and fc["source"] != "given":
        kept = getattr(runtime.controller.system.predictor, "kept", None)  # known once the runtime closed
        stats["forecaster"] = {**fc, "kept": kept}
        print(f"forecaster: learned online ({'from the cache' if fc['source'] == 'cache' else 'new'}), "
              f"{fc['tokens_learned']} tokens learned in use, {fc['swaps']} swaps this run; "
              + (f"kept for the model's next run with {kept} tokens learned" if kept is not None else
                 "nothing new kept for the next run (fewer tokens than a round needs)"))
    if args.json:
        print(json.dumps(stats))
    return 0


def run_bench(args) -> int:
    """`seqmoe bench-runtime`: the table, then one JSON line (also appended to --out)."""
    load, base = offload_configs(args)  # miss, control, expert precision; the paths of --train and --predictor
    residencies = floats(args.residencies, "--residencies")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems:
        raise UserError("--systems is empty")
    for r in residencies:
        check_residency(r)
    for s in systems:  # the bench collects a training trace and trains a forecaster when none is given
        check_live_system(s, train=not args.online, predictor=not args.online)
    if args.online and (args.train or args.predictor):
        raise UserError("--online starts cold: drop --train and --predictor")
    check_bench(args.new_tokens, args.repeats, args.link_ratio)
    import torch  # torch: only when this runs

    from seqmoe.arch.collect import load_model  # torch: only when this runs
    from seqmoe.runtime.timing.decode import PROMPTS, bench_runtime, format_table  # torch: only when this runs

    torch.set_num_threads(load.torch_threads())
    train = load_trace(args.train) if args.train else None
    model, tok = load_model(load.model, device="cpu", dtype=load.dtype, progress=progress(args))
    if tok is None:
        raise UserError(f"{load.model} has no tokenizer files; bench-runtime needs one to encode the prompts")
    log = lambda line: print(f"seqmoe: {line}", file=sys.stderr)  # noqa: E731
    result = bench_runtime(model, tok, args.prompt or PROMPTS, residencies=residencies, systems=systems,
                           new_tokens=args.new_tokens, repeats=args.repeats, train=train, predictor=args.predictor,
                           link_ratio=args.link_ratio, predictor_minutes=args.predictor_minutes, log=log,
                           config=base, online=args.online, prompt_lengths=args.prompt_lengths)
    result["model"] = str(load.model)
    print(format_table(result))
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0

"""`seqmoe trace ...`: collect, import, inspect and split routing traces.

    seqmoe trace collect --model seqmoe-tiny --text prompts.txt --out tiny.safetensors --pregate 2
    seqmoe trace import ../shared/data/traces/deepseek-v2-lite-puffin --out puffin.safetensors
    seqmoe trace info puffin.safetensors --json
    seqmoe trace split puffin.safetensors --train train.safetensors --test test.safetensors --test-fraction 0.1

`add_trace_commands(subparsers)` registers the command on the main parser (src/seqmoe/cli/__init__.py);
every subcommand sets `func(args) -> int`. Bad input raises `UserError`, which the main CLI
prints as one line before exiting with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from seqmoe.base.errors import UserError, needs_extra
from seqmoe.base.files import atomic_path
from seqmoe.cli.args import progress
from seqmoe.trace.io import ACCEPTED, load_trace, save_trace, write_trace_file
from seqmoe.trace.schema import RoutingTrace
from seqmoe.trace.split import split_trace
from seqmoe.trace.stats import summarize


def add_trace_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `trace collect|import|info|split` to the main parser's subparsers; returns the `trace` parser."""
    trace = subparsers.add_parser(
        "trace",
        help="collect, import, inspect and split routing traces",
        description="Record routing traces from a transformers MoE model, import them from other formats, "
        "print their statistics, split them by request.",
    )
    sub = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)
    _add_collect(sub)

    imp = sub.add_parser(
        "import",
        help="convert a trace to seqmoe's .safetensors format",
        description=f"Load SRC and save it as a seqmoe trace; SRC is {ACCEPTED.removeprefix('expected ')}.",
    )
    imp.add_argument("src", metavar="SRC", help="trace file or folder to import")
    imp.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to write the trace")
    imp.add_argument(
        "--num-experts", type=int, default=None, metavar="E",
        help="routed experts per layer (default: the format's model: 64 for CSV, 8 for JSONL)",
    )  # fmt: skip
    imp.set_defaults(func=run_import)

    info = sub.add_parser(
        "info",
        help="print a trace's shape and routing statistics",
        description="Print shape, popularity skew, token reuse and layer affinity of a trace (saved or importable).",
    )
    info.add_argument("path", metavar="PATH", help="trace file or folder")
    info.add_argument(
        "--json", action="store_true", help="also print the statistics as one JSON object on the last line"
    )
    info.set_defaults(func=run_info)

    split = sub.add_parser(
        "split",
        help="split a trace by request into train and test files",
        description="Split PATH by whole requests (seeded, reproducible); both parts keep the original request order.",
    )
    split.add_argument("path", metavar="PATH", help="trace file or folder to split")
    split.add_argument("--train", required=True, metavar="OUT", help="where to write the training part (.safetensors)")
    split.add_argument("--test", required=True, metavar="OUT", help="where to write the test part (.safetensors)")
    size = split.add_mutually_exclusive_group(required=True)
    size.add_argument("--test-fraction", type=float, metavar="F", help="share of requests for the test part, in (0, 1)")
    size.add_argument("--num-test", type=int, metavar="N", help="number of requests for the test part")
    split.add_argument("--seed", type=int, default=0, help="seed of the request permutation (default: 0)")
    split.set_defaults(func=run_split)
    return trace


def _add_collect(sub: argparse._SubParsersAction) -> None:
    col = sub.add_parser(
        "collect",
        help="record a trace by running a transformers MoE model over text",
        description="Run a transformers MoE causal LM (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS, "
        "...) over text, one request at a time, and record through hooks on its router modules the experts "
        "and gate weights every token gets at every MoE layer, plus the token ids and request boundaries. "
        "Needs torch and transformers (pip install 'seqmoe[hf]'); nothing is downloaded.",
        epilog="The trace's layer axis counts MoE layers only (dense layers such as DeepSeek's first_k_dense_replace "
        "are skipped); meta.extra['moe_layers'] maps it to decoder layer indices.",
    )
    col.add_argument("--model", required=True, metavar="PATH_OR_NAME",
                     help="local model folder with config.json and a tokenizer, or seqmoe-tiny")
    col.add_argument("--text", required=True, metavar="FILE_OR_DIR",
                     help="UTF-8 text file, or a folder whose *.txt files (any depth, sorted) are read")
    col.add_argument("--out", required=True, metavar="TRACE.safetensors", help="where to write the trace")
    col.add_argument("--requests", choices=("paragraph", "file"), default="paragraph",
                     help="one request per blank-line-separated paragraph (default) or per file")
    col.add_argument("--mode", choices=("prompt", "decode"), default="prompt",
                     help="prompt: one forward over each request (default); decode: greedy generate "
                     "--new-tokens tokens after each request with KV cache, and record prompt + generated tokens")
    col.add_argument("--new-tokens", type=int, default=32, metavar="N",
                     help="tokens to generate per request in decode mode (default: 32)")
    col.add_argument("--pregate", type=int, default=0, metavar="H",
                     help="also record, for each MoE layer l, the logits that the routers of layers l+1..l+H give "
                     "to layer l's router input (pregate_logits [T, L, H, E] float16; default: 0, none)")
    col.add_argument("--router-logits", action="store_true",
                     help="also record each router's own logits (router_logits [T, L, E] float32), what the "
                     "simulator's --routing cache-aware needs")
    col.add_argument("--max-tokens", type=int, default=None, metavar="N",
                     help="cut each request to its first N tokens (default: the model's context length)")
    col.add_argument("--max-requests", type=int, default=None, metavar="N", help="route only the first N requests")
    col.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    col.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                     help="weights dtype (default: auto, the checkpoint's)")
    # Also accepted after `collect` (the main parser adds it after `trace`); SUPPRESS keeps that value when absent.
    col.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS, help="never show progress bars")
    col.set_defaults(func=run_collect)


def run_collect(args: argparse.Namespace) -> int:
    """`seqmoe trace collect --model M --text T --out FILE`: print one summary line."""
    for name in ("new_tokens", "max_tokens", "max_requests"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.pregate < 0:
        raise UserError(f"--pregate must be >= 0, got {args.pregate}")
    try:
        from seqmoe.arch.collect.collector import collect_trace, read_text_requests  # torch: only when this runs
        from seqmoe.arch.collect.models import load_model, resolve_model_dir  # torch: only when this runs
    except ImportError as e:
        raise needs_extra("trace collection needs torch and transformers", "hf", e) from None

    texts, labels = read_text_requests(args.text, args.requests)
    if args.max_requests:
        texts, labels = texts[: args.max_requests], labels[: args.max_requests]
    model_dir = resolve_model_dir(args.model)
    model, tokenizer = load_model(model_dir, device=args.device, dtype=args.dtype)
    if tokenizer is None:
        raise UserError(f"{model_dir} has no tokenizer; save one next to the model (tokenizer.save_pretrained)")
    trace = collect_trace(
        model, texts, tokenizer, pregate=args.pregate, router_logits=args.router_logits, mode=args.mode,
        new_tokens=args.new_tokens, max_tokens=args.max_tokens, labels=labels, model_name=str(args.model),
        source=f"seqmoe trace collect --mode {args.mode} --text {args.text}",
        progress=progress(args),
    )  # fmt: skip
    save_trace(trace, args.out)
    print(f"{_describe(trace)} from {args.text} -> {args.out}")
    return 0


def run_import(args: argparse.Namespace) -> int:
    """`seqmoe trace import SRC --out FILE`: print one summary line."""
    trace = load_trace(args.src, num_experts=args.num_experts)
    save_trace(trace, args.out)
    print(f"{_describe(trace)} from {args.src} -> {args.out}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    """`seqmoe trace info PATH [--json]`: a readable table, then optionally one JSON line."""
    trace = load_trace(args.path)
    summary = summarize(trace)
    print(_format_table(args.path, trace, summary))
    if args.json:
        print(json.dumps(summary))
    return 0


def run_split(args: argparse.Namespace) -> int:
    """`seqmoe trace split PATH --train OUT --test OUT (--test-fraction F | --num-test N)`."""
    if Path(args.train).resolve() == Path(args.test).resolve():
        raise UserError(f"--train and --test name the same file ({args.train}); give two different paths")
    for flag, out in (("--train", args.train), ("--test", args.test)):
        if Path(out).resolve() == Path(args.path).resolve():
            raise UserError(f"{flag} {out} is the trace being split; write the parts to other files")
    trace = load_trace(args.path)
    train, test = split_trace(trace, test_fraction=args.test_fraction, num_test=args.num_test, seed=args.seed)
    # Both files appear together or neither does.
    with atomic_path(args.train) as train_tmp, atomic_path(args.test) as test_tmp:
        write_trace_file(train, train_tmp)
        write_trace_file(test, test_tmp)
    print(f"train: {_describe(train)} -> {args.train}; test: {_describe(test)} -> {args.test}")
    return 0


def _describe(trace: RoutingTrace) -> str:
    return (
        f"{trace.num_requests} requests, {trace.num_tokens} tokens, "
        f"L={trace.num_layers} E={trace.num_experts} K={trace.top_k} ({trace.meta.model})"
    )


def _format_table(path: str | os.PathLike, trace: RoutingTrace, s: dict) -> str:
    fields = [name for name in ("gate_weights", "token_ids") if getattr(trace, name) is not None]
    if trace.pregate_logits is not None:
        fields.append(f"pregate_logits (H={trace.pregate_logits.shape[2]})")
    if trace.router_logits is not None:
        fields.append("router_logits")
    if trace.vocab is not None:
        fields.append(f"vocab ({len(trace.vocab)} strings)")
    rows = [
        ("trace", str(path)),
        ("model", s["model"]),
        ("source", s["source"]),
        ("shape", f"T={s['num_tokens']} tokens, L={s['num_layers']} layers, "
                  f"K={s['top_k']} of E={s['num_experts']} experts"),
        ("requests", f"{s['num_requests']} (tokens each: min {s['request_tokens_min']}, "
                     f"median {s['request_tokens_median']:g}, max {s['request_tokens_max']})"),
        ("fields", ", ".join(fields) or "expert ids only"),
        ("token reuse", f"{_fmt(s['token_reuse'])} (random {_fmt(s['token_reuse_random'])})"),
        ("layer affinity", f"{_fmt(s['layer_affinity'])} (most-popular guess {_fmt(s['layer_affinity_popular'])}, "
                           f"random {_fmt(s['layer_affinity_random'])})"),
    ]  # fmt: skip
    lines = [f"{key:<15} {value}" for key, value in rows]
    top = f"top{s['skew_num_top']}_share"
    lines += ["", f"{'layer':>5}  {top:>12}  {'entropy':>8}  {'reuse':>6}  {'affinity':>8}"]
    affinity = s["layer_affinity_by_layer"] + [None]  # the last layer has no next layer
    for l in range(s["num_layers"]):
        lines.append(
            f"{l:>5}  {_fmt(s['skew_top_share'][l]):>12}  {_fmt(s['skew_entropy'][l]):>8}  "
            f"{_fmt(s['token_reuse_by_layer'][l]):>6}  {_fmt(affinity[l]):>8}"
        )
    lines.append(f"(top share uniform: {_fmt(s['skew_top_share_uniform'])}; affinity: layer l -> l+1)")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"

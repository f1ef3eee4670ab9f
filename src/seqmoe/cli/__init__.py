"""The `seqmoe` command (also `python -m seqmoe`). It parses flags, builds configs, calls the library
and writes output; bad input, a bad flag included, ends with one line `seqmoe: error: ...` and exit
code 2. One module per group of commands: `sim` (demo, sim, sweep, plot, systems, profiles),
`trace`, `predict` (train, eval-predictor), `runtime` (generate, bench-runtime), `serve`; `args`
holds what their parsing shares.

    seqmoe demo
    seqmoe sim --trace TEST --train TRAIN --residency 0.45 --system on-demand-lru --json
    seqmoe trace info TRACE
"""

from __future__ import annotations

import sys
import warnings

from seqmoe.cli.args import Parser
from seqmoe.cli.predict import add_predict_commands
from seqmoe.cli.runtime import add_runtime_commands
from seqmoe.cli.serve import add_serve_commands
from seqmoe.cli.sim import add_sim_commands
from seqmoe.cli.trace import add_trace_commands
from seqmoe.base.errors import Note, UserError
from seqmoe.base.heap import keep_freed_blocks


def build_parser() -> Parser:
    p = Parser(
        prog="seqmoe",
        description="Keep the right MoE experts resident: routing traces, predictors, prefetch schedulers, "
        "caches, a trace-driven simulator and an offloading runtime.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_sim_commands(sub)
    add_predict_commands(sub)
    add_trace_commands(sub)
    add_runtime_commands(sub)
    add_serve_commands(sub)
    for action in sub.choices.values():
        action.add_argument("--no-progress", action="store_true", help="never show progress bars")
    return p


def _note(message, category, filename, lineno, line=None) -> str:
    """A warning as the command prints it: one line, without the source line that raised it."""
    return f"seqmoe: note: {message}\n" if issubclass(category, Note) else _plain(
        message, category, filename, lineno, line)


_plain = warnings.formatwarning


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    warnings.formatwarning = _note  # this process is the command's: its notes read as its other lines
    keep_freed_blocks()  # and its allocator: a decode step's buffers are reused, not mapped anew at each layer
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        return args.func(args)
    except UserError as e:
        print(f"seqmoe: error: {e}", file=sys.stderr)
        return 2

"""What every command's parsing shares: flags generated from the configuration dataclasses (each
field's docstring is its help), comma lists, the progress switch, and a parser whose errors are
one line.

    add_config_flags(parser, OffloadConfig, skip=("residency",))
    cfg = config_from_args(OffloadConfig, args, control="thread")     # the config checks every value
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys

from seqmoe.config import CLI, SHOWN_DEFAULT
from seqmoe.base.errors import UserError


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose parse errors raise `UserError`, so `main` prints them as every other
    error: one line, `seqmoe: error: ...`, exit code 2. Flags are never abbreviated: `--system` is
    not `--systems`, nor `--residency` `--residencies`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass (its own, or a base class's), by field name."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _flag_type(annotation: str):
    """The argparse type of a field: its first scalar type (`str | HardwareProfile | None` reads as str)."""
    first = annotation.split("|")[0].strip()
    return {"float": float, "int": int}.get(first, str)


def add_config_flags(parser, cls, skip: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """Add one kebab-case flag per field of dataclass `cls` (but `skip` and those marked `CLI: False`),
    with its docstring as help and its default (or `defaults[name]`)."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get(CLI, True):
            continue
        required = f.default is dataclasses.MISSING
        own = getattr(cls, "DEFAULTS", {}).get(f.name, f.default)  # this context's default of a shared field
        # a shared field's flag stays None unless given (the config fills its context's default): a config can
        # tell a value the user gave (e.g. --residency beside --expert-memory) from its default
        default = None if required else (defaults or {}).get(f.name, f.default)
        shown = f.metadata.get(SHOWN_DEFAULT, own if default is None else default)
        suffix = "" if required or shown is None else f" (default: {shown})"
        help = (docs.get(f.name, "") + suffix).replace("%", "%%")  # argparse formats help with %
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) == "bool":  # a switch, off by default
            parser.add_argument(flag, action="store_true", help=docs.get(f.name, "").replace("%", "%%"))
            continue
        parser.add_argument(flag, type=_flag_type(str(f.type)), default=default,
                            required=required, metavar=f.metadata.get("metavar"), help=help)


def config_from_args(cls, args, **overrides):
    """Build `cls` from parsed flags (fields only), then `overrides`."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def floats(text: str, what: str) -> list[float]:
    """The comma-separated numbers of flag `what`; UserError if there are none or one is not a number."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not out:
        raise UserError(f"{what} is empty")
    return out


def prompt_lengths(text: str) -> tuple[int, ...]:
    """`--prompt-lengths`: comma-separated positive ints (empty: none)."""
    try:
        got = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if any(n < 1 for n in got):
        raise argparse.ArgumentTypeError(f"a prompt has at least 1 token, got {text!r}")
    return got


def progress(args) -> bool:
    """Show progress bars: not turned off, and stderr is a terminal."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()

"""Expert precisions and memory budgets: how many bytes one routed expert takes when the runtime
stores it quantized, and budgets given in bytes. No torch here: the simulator prices precisions
with the same arithmetic the runtime packs them with (`seqmoe.arch.quant`).

    quantized_bytes(3 * 2048 * 1408, "int4")    # bytes of an expert of that many weights, scales included
    parse_bytes("12GiB"), format_bytes(12 << 30)

Each weight matrix of an expert is quantized in groups of `GROUP` consecutive weights (of its
flattened slice), each group with one float32 scale: symmetric absmax, int8 codes in [-127, 127],
int4 codes in [-7, 7] (two per byte), or fp8 e4m3 codes (torch's `float8_e4m3fn`, scale =
absmax / 448). Vectors (biases) stay at the model's dtype.
"""

from __future__ import annotations

import math
import re

from seqmoe.base.errors import UserError

PRECISIONS = ("int8", "int4", "fp8")
"""The precisions an expert store may take (None keeps the model's)."""
GROUP = 64
"""Weights per scale."""
SCALE_BYTES = 4
"""Bytes of one scale (float32)."""
CODE_BITS = {"int8": 8, "int4": 4, "fp8": 8}
"""Bits per weight code."""
QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
"""The largest code magnitude: a group's absmax maps to it."""

_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def check_precision(precision: str | None) -> str | None:
    """`precision` when it is None or one of `PRECISIONS`; UserError otherwise."""
    if precision is not None and precision not in PRECISIONS:
        raise UserError(f"unknown expert precision {precision!r}; choose one of: {', '.join(PRECISIONS)} "
                        "(or none, to keep the model's)")
    return precision


def quantized_bytes(numel: int, precision: str) -> int:
    """Bytes of `numel` weights stored at `precision`: codes of whole groups, then their scales."""
    groups = math.ceil(numel / GROUP)
    return groups * GROUP * CODE_BITS[precision] // 8 + groups * SCALE_BYTES


def parse_bytes(text: str | int, what: str = "memory budget") -> int:
    """Bytes from an int or a string like "12GiB", "2MiB", "512KiB", "1.5GiB" or "4096" (binary
    units); UserError for anything else or a budget that is not positive."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]iB|B)?\s*", str(text))
        if m is None:
            raise UserError(f"{what} {text!r} is not a size: give bytes, or a number with KiB, MiB, GiB or TiB "
                            "(e.g. 12GiB)")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value <= 0:
        raise UserError(f"{what} must be more than 0 bytes, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps it at least 1 (e.g. "1.50 GiB")."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.2f} {unit}"
    return f"{int(n)} B"

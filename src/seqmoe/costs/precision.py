"""Expert precisions and memory budgets: how many bytes one routed expert takes when the runtime
stores it quantized, and budgets given in bytes. No torch here: the simulator prices precisions
with the same arithmetic the runtime packs them with (`seqmoe.arch.quant`).

    quantized_bytes(3 * 2048 * 1408, "int4")    # bytes of an expert of that many weights, scales included
    parse_bytes("12GiB"), format_bytes(12 << 30)

Each weight matrix of an expert is quantized in groups of `GROUP` consecutive weights (of its
flattened slice), each group with one float32 scale: symmetric absmax, int8 codes in [-127, 127],
int4 codes in [-7, 7] (two per byte), or fp8 e4m3 codes (torch's `float8_e4m3fn`, scale =
absmax / 448). Vectors (biases) stay at the model's dtype.

The formats checkpoints ship in (`SHIPPED`) are priced here too, matrix by matrix as their files store
them (`matrix_bytes`): the simulator takes them as an expert precision, and `seqmoe.arch.shipped`
encodes and decodes them.
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

SHIPPED = {
    "fp8-block": "float8 e4m3 codes, a float32 scale (weight_scale_inv) per 128 x 128 block (DeepSeek-V3, Qwen3-FP8)",
    "mxfp4": "OCP MXFP4: e2m1 codes two a byte, an E8M0 exponent byte per 32 inputs (gpt-oss)",
    "gptq-int4": "GPTQ 4-bit, groups of 128 inputs: int32-packed codes, float16 scales, packed 4-bit zeros, an "
                 "int32 group index per input (Qwen's GPTQ-Int4 releases)",
    "q8_0": "GGUF Q8_0: blocks of 32 inputs, a float16 scale and 32 int8 codes (34 bytes)",
    "q5_0": "GGUF Q5_0: blocks of 32 inputs in 22 bytes (a float16 scale, 32 5-bit codes); llama.cpp's "
            "fallback for a Q4_K matrix whose inputs are not a multiple of 256",
    "q4_k": "GGUF Q4_K: super-blocks of 256 inputs in 144 bytes (float16 d and dmin, eight 6-bit scales and "
            "mins, 256 4-bit codes)",
}
"""The formats checkpoints ship their experts in: what `matrix_bytes` prices, named as `--expert-dtype` takes them."""
SHIPPED_BLOCK = {"fp8-block": 128, "mxfp4": 32, "gptq-int4": 128, "q8_0": 32, "q5_0": 32, "q4_k": 256}
"""Inputs per block (per scale) of each shipped format; fp8-block's blocks are that many outputs too
(another side: "fp8-block-N", `fp8_block_size`)."""

_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def fp8_block_size(precision) -> int | None:
    """The block side of an FP8-block precision: 128 for "fp8-block", N for "fp8-block-N" (a release
    whose config names weight_block_size [N, N]); None for any other precision."""
    if precision == "fp8-block":
        return 128
    m = re.fullmatch(r"fp8-block-([1-9][0-9]{0,3})", precision) if isinstance(precision, str) else None
    return int(m.group(1)) if m else None


def _shipped_name(precision) -> bool:
    return precision in SHIPPED or fp8_block_size(precision) is not None


def check_precision(precision: str | None, shipped: bool = False) -> str | None:
    """`precision` when it is None or one of `PRECISIONS` (or, with `shipped`, of `SHIPPED`, or shipped
    formats per matrix: `shipped_formats`); UserError otherwise."""
    known = PRECISIONS + (tuple(SHIPPED) if shipped else ())
    if precision is not None and precision not in known and not (shipped and (_mixed(precision) or _shipped_name(precision))):
        raise UserError(f"unknown expert precision {precision!r}; choose one of: {', '.join(known)} "
                        + ("or one shipped format per matrix, e.g. q4_k/q4_k/q5_0 " if shipped else "")
                        + "(or none, to keep the model's)")
    return precision


def _mixed(precision) -> bool:
    parts = precision.split("/") if isinstance(precision, str) else ()
    return len(parts) > 1 and all(_shipped_name(p) for p in parts)


def is_shipped(precision: str | None) -> bool:
    """Whether `precision` names a shipped format, or one per matrix (`shipped_formats`)."""
    return _shipped_name(precision) or _mixed(precision)


def shipped_formats(precision: str, matrices: int) -> tuple[str, ...]:
    """The format of each of an expert's `matrices` weight matrices (in checkpoint order: gate, up, down):
    one shipped format for all, or one per matrix joined by "/" (a GGUF file's mix, e.g. q4_k/q4_k/q5_0)."""
    parts = tuple(precision.split("/"))
    if len(parts) == 1:
        return parts * matrices
    if len(parts) != matrices:
        raise UserError(f"expert precision {precision!r} names {len(parts)} formats, but an expert has {matrices} "
                        "weight matrices: give one format, or one per matrix")
    return parts


def matrix_bytes(rows: int, cols: int, precision: str) -> int:
    """Bytes of a [rows (outputs), cols (inputs)] weight matrix stored at `precision` (a runtime one or
    a shipped one), scales and zero points included; UserError where the format cannot store that shape."""
    if precision in PRECISIONS:
        return quantized_bytes(rows * cols, precision)
    check_precision(precision, shipped=True)
    block = fp8_block_size(precision)
    if block is not None:
        return rows * cols + -(-rows // block) * -(-cols // block) * 4
    block = SHIPPED_BLOCK[precision]
    if cols % block or (precision == "gptq-int4" and rows % 8):
        raise UserError(f"{precision} stores a matrix's inputs in whole blocks of {block}"
                        + (" and its outputs in eights" if precision == "gptq-int4" else "")
                        + f": a [{rows}, {cols}] matrix does not fit; price it at another precision")
    blocks = rows * cols // block
    if precision == "mxfp4":
        return blocks * (block // 2 + 1)
    if precision == "q8_0":
        return blocks * (2 + block)
    if precision == "q5_0":
        return blocks * 22
    if precision == "q4_k":
        return blocks * 144
    return rows * cols // 2 + blocks * 2 + blocks // 2 + cols * 4  # gptq-int4: codes, scales, zeros, g_idx


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

"""Quantized experts: one expert packed in one row of bytes at a lower precision, and the same
quantization applied to a model in place.

    layout = QuantLayout.of(arch.layout(experts), "int4")   # rows of layout.numel bytes
    layout.pack(experts, host)       # host [E, B] uint8: codes and float32 scales per weight matrix
    layout.views(host[[3, 5]])       # {"gate_up_proj": [2, 2I, H], ...}: dequantized, the model's dtype
    quantize_experts(model, "int4")  # the model's experts replaced by the same dequantized weights
    converted_precision(folder)      # "int4" for a folder `seqmoe convert` wrote, None otherwise

The format is `seqmoe.costs.precision`'s (groups of 64 weights, symmetric absmax, float32 scales; fp8 as
torch's float8_e4m3fn). A row holds, for each parameter of the expert in layout order, its codes
then its scales, each part 4-byte aligned; vectors (biases) are kept as their raw bytes. `views`
dequantizes into new tensors (not views): the runtime computes from those, and `quantize_experts`
writes exactly those numbers into the model, so an offloaded model and its full-load reference read
the same weights.

The quantizer is written here, ten lines of torch: torchao's `quantize_affine` primitives give the
same quality on seqmoe-tiny (docs/LOG.md, issue 25) but print failed CUDA-extension loads on a CPU
machine and add seconds to every import.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from seqmoe.arch.adapter import model_arch
from seqmoe.arch.layout import ExpertLayout
from seqmoe.base.errors import UserError
from seqmoe.arch.gguf_file import gguf_file, gguf_precision
from seqmoe.arch.shipped import shipped_precision
from seqmoe.arch.shipped_layout import ShippedLayout
from seqmoe.costs.precision import GROUP, QMAX, SCALE_BYTES, check_precision, is_shipped, quantized_bytes


def _align(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class _Part:
    name: str
    shape: tuple[int, ...]
    offset: int
    """First byte of the part in the row."""
    code_bytes: int
    """Bytes of its codes (0: a vector kept raw, in `raw_bytes`)."""
    raw_bytes: int


@dataclass(frozen=True)
class QuantLayout:
    """The byte row of one expert at `precision`; same interface as `ExpertLayout`."""

    base: ExpertLayout
    """The expert's layout at the model's dtype."""
    precision: str
    parts: tuple[_Part, ...]
    numel: int
    """B: bytes per expert row."""

    dtype = torch.uint8
    in_place = False
    """Rows are not the parameters' numbers: `views` dequantizes (a window of slots cannot be read in place)."""

    @classmethod
    def of(cls, base: ExpertLayout, precision: str) -> QuantLayout:
        check_precision(precision)
        parts, at = [], 0
        for name, shape in zip(base.names, base.shapes):
            numel = math.prod(shape)
            if len(shape) >= 2:
                code, raw = quantized_bytes(numel, precision) - math.ceil(numel / GROUP) * SCALE_BYTES, 0
            else:
                code, raw = 0, numel * base.expert_bytes // base.numel
            parts.append(_Part(name, tuple(shape), at, code, raw))
            at += _align(code + math.ceil(numel / GROUP) * SCALE_BYTES if code else raw)
        return cls(base, precision, tuple(parts), at)

    names = property(lambda self: self.base.names)
    shapes = property(lambda self: self.base.shapes)
    compute_dtype = property(lambda self: self.base.dtype, doc="The dtype the experts compute in (the model's).")

    @property
    def expert_bytes(self) -> int:
        return self.numel

    def pack(self, experts: torch.nn.Module, out: torch.Tensor) -> None:
        """Quantize the parameters of `experts` into `out` [E, B] uint8 (one row per expert)."""
        for part in self.parts:
            p = getattr(experts, part.name).detach()
            self._write(part, p.reshape(p.shape[0], -1), out)

    def pack_rows(self, base_rows: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize `base_rows` [n, P] (experts packed by `base`, e.g. read from a checkpoint) into
        `out` [n, B] uint8: the bytes `pack` gives for the same experts."""
        self.pack_views(self.base.views(base_rows), out)

    def pack_views(self, views: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Quantize n experts' parameters `views` ({name: [n, *shape]}, e.g. another layout's `views`)
        into `out` [n, B] uint8."""
        for part in self.parts:
            self._write(part, views[part.name].reshape(out.shape[0], -1), out)

    def _write(self, part: _Part, flat: torch.Tensor, out: torch.Tensor) -> None:
        """Part `part` of n experts, `flat` [n, numel], into its bytes of `out` [n, B]."""
        if part.code_bytes:
            codes, scales = quantize(flat, self.precision)
            out[:, part.offset:part.offset + part.code_bytes].copy_(codes)
            at = part.offset + part.code_bytes
            out[:, at:at + scales.shape[1] * SCALE_BYTES].copy_(scales.view(torch.uint8))
        else:
            out[:, part.offset:part.offset + part.raw_bytes].copy_(flat.contiguous().view(torch.uint8))

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters of an n-expert module dequantized from `rows` [n, B] ({name: [n, *shape]},
        new tensors in the model's dtype)."""
        n, out = rows.shape[0], {}
        for part in self.parts:
            numel = math.prod(part.shape)
            if part.code_bytes:
                at = part.offset + part.code_bytes
                scales = rows[:, at:at + math.ceil(numel / GROUP) * SCALE_BYTES].view(torch.float32)
                w = dequantize(rows[:, part.offset:at], scales, self.precision, numel)
            else:
                w = rows[:, part.offset:part.offset + part.raw_bytes].view(self.base.dtype)
            out[part.name] = w.to(self.base.dtype).view(n, *part.shape)
        return out

    def strip(self, experts: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return self.base.strip(experts)

    def unpack(self, experts: torch.nn.Module, host: torch.Tensor, device,
               params: dict[str, torch.nn.Parameter] | None = None) -> None:
        """Give `experts` its parameters back from `host` [E, B], dequantized (the weights the
        runtime computed with), on `device`."""
        for name, value in self.views(host).items():
            param = (params or {}).get(name)
            data = value.to(device).contiguous()
            if param is None:
                param = torch.nn.Parameter(data, requires_grad=False)
            else:
                param.data = data
            experts.register_parameter(name, param)


def quantize(w: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [E, code bytes] uint8, scales [E, groups] float32) of `w` [E, numel], group by group."""
    E, numel = w.shape
    groups = math.ceil(numel / GROUP)
    f = torch.zeros((E, groups * GROUP), dtype=torch.float32, device=w.device)
    f[:, :numel] = w.float()
    f = f.view(E, groups, GROUP)
    scales = f.abs().amax(-1) / QMAX[precision]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: codes 0
    x = f / scales[..., None]
    if precision == "fp8":
        codes = x.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = torch.round(x).clamp_(-QMAX[precision], QMAX[precision]).to(torch.int8)
        codes = q.view(torch.uint8) if precision == "int8" else _pack_nibbles(q)
    return codes.reshape(E, -1), scales.contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, precision: str, numel: int) -> torch.Tensor:
    """[n, numel] float32 weights from `codes` [n, code bytes] uint8 and `scales` [n, groups] float32."""
    n, groups = scales.shape
    if precision == "fp8":
        q = codes.view(torch.float8_e4m3fn).float()
    elif precision == "int8":
        q = codes.view(torch.int8).float()
    else:
        q = _unpack_nibbles(codes).float()
    return (q.view(n, groups, GROUP) * scales[..., None]).view(n, groups * GROUP)[:, :numel]


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 codes in [-7, 7] (int8) -> bytes, two codes a byte (the even one low)."""
    u = (q.reshape(q.shape[0], -1, 2) + 8).to(torch.uint8)
    return u[..., 0] | (u[..., 1] << 4)


def _unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """`_pack_nibbles`' inverse: [n, bytes] uint8 -> [n, 2 x bytes] int8 in [-8, 7]."""
    lo, hi = (b & 0xF).to(torch.int8) - 8, (b >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), -1).view(b.shape[0], -1)


def store_layout(base: ExpertLayout, precision: str | None):
    """The rows an expert store of `precision` keeps: `base` (None), a `QuantLayout` (int8, int4, fp8) or a
    `ShippedLayout` (a format checkpoints ship in, `seqmoe.arch.shipped_layout`)."""
    if precision is None:
        return base
    check_precision(precision, shipped=True)
    return ShippedLayout.of(base, precision) if is_shipped(precision) else QuantLayout.of(base, precision)


def quantize_experts(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Replace the routed experts' weights of `model`, in place, by their dequantized values at
    `precision` (the numbers an offloaded model stores and computes with), so that the full-load
    model is the reference of `offload(..., expert_dtype=precision)`. Returns `model`."""
    check_precision(precision, shipped=True)
    arch = model_arch(model)
    for layer in arch.moe:
        experts = layer.experts
        layout = store_layout(arch.layout(experts), precision)
        rows = torch.empty((experts.num_experts, layout.numel), dtype=torch.uint8)
        layout.pack(experts, rows)
        for name, value in layout.views(rows).items():
            param = getattr(experts, name)
            param.data = value.to(param.device).contiguous()
    return model


CONVERTED = "seqmoe_experts.json"
"""The file that marks a checkpoint folder written by `seqmoe convert` (docs/DESIGN.md, "Converted checkpoints")."""
ROWS_SUFFIX = "seqmoe_rows"
"""A converted MoE layer's experts are one [E, B] uint8 tensor, `{experts module path}.seqmoe_rows`."""
CONVERTED_FORMAT = 1


def stored_precision(folder) -> str | None:
    """The precision a checkpoint (a folder, or a GGUF file) stores its routed experts at, when not the
    model's dtype: what `seqmoe convert` wrote, the format it ships in (`shipped_precision`), or a GGUF
    file's block formats (`gguf_precision`); None otherwise."""
    gguf = gguf_file(folder)
    if gguf is not None:
        return gguf_precision(gguf)
    return converted_precision(folder) or shipped_precision(folder)


def converted_precision(folder) -> str | None:
    """The expert precision of a folder `seqmoe convert` wrote (None: not converted); UserError when its
    marker is malformed or of a format this version does not read."""
    path = Path(folder) / CONVERTED
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        fmt, precision = meta["format"], meta["precision"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path} is malformed (want JSON with format and precision); convert the checkpoint "
                        "again") from None
    if fmt != CONVERTED_FORMAT:
        raise UserError(f"{path} is format {fmt!r}; this seqmoe reads format {CONVERTED_FORMAT}: convert the "
                        "checkpoint again with it")
    return check_precision(precision, shipped=True)

"""`ShippedLayout`: one expert's row holding its weight matrices in a format checkpoints ship in
(`seqmoe.arch.shipped`), the file's own tensors byte for byte; same interface as `QuantLayout`.

    layout = ShippedLayout.of(arch.layout(experts), "fp8-block")   # or quant.store_layout(base, precision)
    layout.matrices                 # [(param, piece, rows, cols, format)]: the linears the file stores, in row order
    layout.part("gate_up_proj", 0, "weight_scale_inv")   # (offset, shape, dtype) of one file tensor in the row
    layout.views(rows)              # {"gate_up_proj": [n, 2I, H], ...}: decoded, the model's dtype

A stacked parameter is stored as the linears its checkpoint has: a `gate_up_proj` [2I, H] as two
[I, H] matrices, gate then up (each with its own blocks, as files store gate_proj and up_proj),
except in a family whose matrices are [inputs, outputs] (gpt-oss), whose file stores the fused,
interleaved gate_up [2I, H] as one matrix (the parameter transposed). Vectors (biases) are kept at the
model's dtype. Each file tensor starts 4-byte aligned in the row. Each linear may have its own format
(a GGUF file's mix, e.g. `q4_k/q4_k/q5_0` for gate, up, down). `pack` encodes a model's experts by
round to nearest (what `--expert-dtype mxfp4` etc. store); a checkpoint shipped in the format fills the
same rows with its own bytes (`seqmoe.runtime.disk.checkpoint`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from seqmoe.arch.layout import ExpertLayout
from seqmoe.arch.shipped import SHIPPED_CODECS
from seqmoe.costs.precision import shipped_formats


def _align(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class ShippedLayout:
    """The byte row of one expert in shipped format `precision` (see the module docstring)."""

    base: ExpertLayout
    precision: str
    """A shipped format, or one per matrix ("q4_k/q4_k/q5_0": `seqmoe.costs.precision.shipped_formats`)."""
    matrices: tuple[tuple[str, int, int, int, str], ...]
    """(parameter, piece, rows, cols, format) of each linear, in row order."""
    offsets: dict
    """(parameter, piece, tensor suffix) -> (offset, shape, dtype) in the row; (parameter, -1, "") -> a vector's."""
    numel: int
    """B: bytes per expert row."""

    dtype = torch.uint8
    in_place = False
    """Rows are codes, not the parameters' numbers: `views` decodes."""

    @classmethod
    def of(cls, base: ExpertLayout, precision: str) -> ShippedLayout:
        linears = []
        for name, shape in zip(base.names, base.shapes):
            if len(shape) >= 2:
                rows, cols = (shape[1], shape[0]) if base.in_out else shape
                pieces = 2 if name == "gate_up_proj" and not base.in_out else 1
                linears += [(name, k, rows // pieces, cols) for k in range(pieces)]
        matrices = tuple(m + (f,) for m, f in zip(linears, shipped_formats(precision, len(linears))))
        offsets, at = {}, 0
        for name, shape in zip(base.names, base.shapes):
            if len(shape) < 2:
                offsets[(name, -1, "")] = (at, tuple(shape), base.dtype)
                at += _align(math.prod(shape) * base.dtype.itemsize)
            for _, k, r, c, f in (m for m in matrices if m[0] == name):
                for suffix, (tshape, tdtype) in SHIPPED_CODECS[f].tensors(r, c).items():
                    offsets[(name, k, suffix)] = (at, tshape, tdtype)
                    at += _align(math.prod(tshape) * tdtype.itemsize)
        return cls(base, precision, matrices, offsets, at)

    def __hash__(self) -> int:
        return hash((self.base, self.precision))

    def __eq__(self, other) -> bool:
        return isinstance(other, ShippedLayout) and (self.base, self.precision) == (other.base, other.precision)

    names = property(lambda self: self.base.names)
    shapes = property(lambda self: self.base.shapes)
    compute_dtype = property(lambda self: self.base.dtype, doc="The dtype the experts compute in (the model's).")

    @property
    def expert_bytes(self) -> int:
        return self.numel

    def part(self, name: str, piece: int, suffix: str) -> tuple[int, tuple[int, ...], torch.dtype]:
        """(offset in the row, shape, dtype) of one file tensor of linear `piece` of parameter `name`."""
        return self.offsets[(name, piece, suffix)]

    def _tensor(self, rows: torch.Tensor, key) -> torch.Tensor:
        at, shape, dtype = self.offsets[key]
        nbytes = math.prod(shape) * dtype.itemsize
        return rows[:, at:at + nbytes].contiguous().view(dtype).view(rows.shape[0], *shape)

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters of an n-expert module decoded from `rows` [n, B] ({name: [n, *shape]}, new
        tensors in the model's dtype)."""
        out, pieces = {}, {}
        for name, k, r, c, f in self.matrices:
            parts = {s: self._tensor(rows, (name, k, s)) for s in SHIPPED_CODECS[f].tensors(r, c)}
            pieces.setdefault(name, []).append(SHIPPED_CODECS[f].decode(parts, r, c))
        for name, shape in zip(self.names, self.shapes):
            if len(shape) < 2:
                w = self._tensor(rows, (name, -1, ""))
            else:
                w = torch.cat(pieces[name], 1) if len(pieces[name]) > 1 else pieces[name][0]
                w = w.transpose(1, 2) if self.base.in_out else w
            out[name] = w.to(self.base.dtype).contiguous()
        return out

    def pack(self, experts: torch.nn.Module, out: torch.Tensor) -> None:
        """Encode the parameters of `experts` into `out` [E, B] uint8 (round to nearest)."""
        self.pack_views({n: getattr(experts, n).detach() for n in self.names}, out)

    def pack_rows(self, base_rows: torch.Tensor, out: torch.Tensor) -> None:
        """Encode `base_rows` [n, P] (experts packed by `base`) into `out` [n, B]."""
        self.pack_views(self.base.views(base_rows), out)

    def pack_views(self, views: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Encode n experts' parameters `views` ({name: [n, *shape]}) into `out` [n, B] uint8."""
        for name, shape in zip(self.names, self.shapes):
            w = views[name]
            if len(shape) < 2:
                self._write(out, (name, -1, ""), w.to(self.base.dtype))
                continue
            w = w.transpose(1, 2) if self.base.in_out else w
            mats = [m for m in self.matrices if m[0] == name]
            for (_, k, _r, _c, f), piece in zip(mats, w.split(w.shape[1] // len(mats), 1)):
                for suffix, t in SHIPPED_CODECS[f].encode(piece).items():
                    self._write(out, (name, k, suffix), t)

    def _write(self, out: torch.Tensor, key, t: torch.Tensor) -> None:
        at = self.offsets[key][0]
        flat = t.contiguous().view(t.shape[0], -1).view(torch.uint8)
        out[:, at:at + flat.shape[1]].copy_(flat)

    def strip(self, experts: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return self.base.strip(experts)

    def unpack(self, experts: torch.nn.Module, host: torch.Tensor, device,
               params: dict[str, torch.nn.Parameter] | None = None) -> None:
        """Give `experts` its parameters back from `host` [E, B], decoded, on `device`."""
        for name, value in self.views(host).items():
            param = (params or {}).get(name)
            data = value.to(device).contiguous()
            if param is None:
                param = torch.nn.Parameter(data, requires_grad=False)
            else:
                param.data = data
            experts.register_parameter(name, param)


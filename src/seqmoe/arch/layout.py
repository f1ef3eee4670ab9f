"""`ExpertLayout`: one expert's slices of its experts module's stacked parameters, packed in one row.

    layout = ExpertLayout.of(experts, ("gate_up_proj", "down_proj"))   # names from `ModelArch.layout`
    layout.pack(experts, host)       # host [E, P]: one contiguous row per expert
    layout.views(host[[3, 5]])       # {"gate_up_proj": [2, 2I, H], "down_proj": [2, H, I]} views
    kept = layout.strip(experts); layout.unpack(experts, host, device, kept)

Each parameter's slice keeps its own layout (GPT-OSS's transposed, interleaved gate_up_proj too),
so the original experts forward reads the views exactly as it read its parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from seqmoe.base.errors import UserError


@dataclass(frozen=True)
class ExpertLayout:
    """Where each routed parameter of one expert lies in its packed row of `numel` numbers."""

    names: tuple[str, ...]
    """Names of the per-expert parameters of the experts module (first dimension E)."""
    shapes: tuple[tuple[int, ...], ...]
    """Shape of one expert's slice of each parameter."""
    offsets: tuple[int, ...]
    """Start of each parameter's slice in the row."""
    numel: int
    """P: numbers per expert."""
    dtype: torch.dtype
    in_out: bool = False
    """Whether the matrices are stored [inputs, outputs] (gpt-oss), not [outputs, inputs] as a linear's weight."""

    in_place = True
    """`views` are views of the rows: the parameters' own numbers (a window of slots can be read in place)."""
    compute_dtype = property(lambda self: self.dtype, doc="The dtype the experts compute in.")

    @classmethod
    def of(cls, experts: torch.nn.Module, names: tuple[str, ...], in_out: bool = False) -> ExpertLayout:
        """The layout of the stacked parameters `names` of `experts` (matrices [inputs, outputs] with
        `in_out`); UserError if their dtypes differ."""
        params = [(n, getattr(experts, n)) for n in names]
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) > 1:
            kind = type(experts).__name__
            raise UserError(f"{kind} mixes parameter dtypes {sorted(map(str, dtypes))}; load the model in one dtype")
        shapes, offsets, at = [], [], 0
        for _, p in params:
            shapes.append(tuple(p.shape[1:]))
            offsets.append(at)
            at += p[0].numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), at, dtypes.pop(), in_out)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one packed expert."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def pack(self, experts: torch.nn.Module, out: torch.Tensor) -> None:
        """Write the parameters of `experts` into `out` [E, P] (one row per expert)."""
        for name, off in zip(self.names, self.offsets):
            p = getattr(experts, name).detach()
            out[:, off:off + p[0].numel()].copy_(p.reshape(p.shape[0], -1))

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of packed `rows` [n, P] as the parameters of an n-expert module ({name: [n, *shape]})."""
        n = rows.shape[0]
        return {name: rows[:, off:off + math.prod(shape)].view(n, *shape)
                for name, shape, off in zip(self.names, self.shapes, self.offsets)}

    def strip(self, experts: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """Take the routed parameters out of `experts` (the packed rows become their only copy); the
        Parameter objects, emptied, for `unpack` to refill (so they keep identity and requires_grad)."""
        kept = {}
        for name in self.names:
            param = experts._parameters.pop(name)
            param.data = param.data.new_empty(0)
            kept[name] = param
        return kept

    def unpack(self, experts: torch.nn.Module, host: torch.Tensor, device,
               params: dict[str, torch.nn.Parameter] | None = None) -> None:
        """Give `experts` its parameters back from the packed `host` [E, P], on `device`: the
        `strip`ped `params` refilled, or new ones without gradients."""
        for name, view in self.views(host).items():
            data = view.to(device, copy=True).contiguous()
            param = (params or {}).get(name)
            if param is None:
                param = torch.nn.Parameter(data, requires_grad=False)
            else:
                param.data = data
            experts.register_parameter(name, param)

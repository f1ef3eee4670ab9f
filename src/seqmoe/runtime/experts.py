"""The experts module the runtime puts in place of each MoE block's `experts`, and the packed layout.

transformers v5 stores a layer's routed experts as 3-D parameters (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I], GPT-OSS also biases [E, X] and a transposed, interleaved layout). The
runtime packs one expert's slices of all of them into one contiguous row of P numbers
(`ExpertLayout`), so that one copy moves one expert, and deletes the parameters.

`OffloadedExperts.forward` has the original signature (hidden_states, top_k_index, top_k_weights).
It gathers the rows of the experts this call routes to (from the device pool when resident, else
from the host block: `ExpertPool.rows`), views them as compact [n, ...] parameters, renumbers the
routed ids to 0..n-1 (order kept) and runs the *original module's own forward* with those bound in
place of its parameters. Every architecture's math (activation, gate/up layout, biases, GPT-OSS's
clamp and alpha, whichever `experts_implementation` the config selects) is therefore the
original's, on the same numbers in the same order: outputs are bit-identical on CPU.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from seqmoe.errors import UserError


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

    @classmethod
    def of(cls, experts: torch.nn.Module, num_experts: int) -> ExpertLayout:
        """The layout of `experts` (a v5 experts module); UserError for other layouts."""
        params = [(n, p) for n, p in experts.named_parameters(recurse=False) if p.ndim >= 2 and p.shape[0] == num_experts]
        kind = type(experts).__name__
        if not params or not any(n.endswith("down_proj") for n, _ in params):
            raise UserError(
                f"{kind} does not hold its {num_experts} experts as stacked 3-D parameters (transformers v5 "
                "layout, e.g. MixtralExperts); this architecture is not supported by the runtime"
            )
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) > 1:
            raise UserError(f"{kind} mixes parameter dtypes {sorted(map(str, dtypes))}; load the model in one dtype")
        names, shapes, offsets, at = [], [], [], 0
        for n, p in params:
            names.append(n)
            shapes.append(tuple(p.shape[1:]))
            offsets.append(at)
            at += p[0].numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), at, dtypes.pop())

    @property
    def expert_bytes(self) -> int:
        """Bytes of one packed expert."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def pack(self, experts: torch.nn.Module, out: torch.Tensor) -> None:
        """Write the parameters of `experts` into `out` [E, P] (one row per expert)."""
        for name, shape, off in zip(self.names, self.shapes, self.offsets):
            p = getattr(experts, name).detach()
            out[:, off:off + p[0].numel()].copy_(p.reshape(p.shape[0], -1))

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of packed `rows` [n, P] as the parameters of an n-expert module ({name: [n, *shape]})."""
        n, out = rows.shape[0], {}
        for name, shape, off in zip(self.names, self.shapes, self.offsets):
            size = 1
            for d in shape:
                size *= d
            out[name] = rows[:, off:off + size].view(n, *shape)
        return out

    def strip(self, experts: torch.nn.Module) -> None:
        """Delete the routed parameters from `experts` (the packed rows become their only copy)."""
        for name in self.names:
            del experts._parameters[name]

    def unpack(self, experts: torch.nn.Module, host: torch.Tensor, device) -> None:
        """Give `experts` its parameters back from the packed `host` [E, P], on `device`."""
        for name, param in self.views(host).items():
            experts.register_parameter(name, torch.nn.Parameter(param.to(device, copy=True).contiguous(), requires_grad=False))


class OffloadedExperts(torch.nn.Module):
    """Drop-in `experts` submodule that reads its weights through the runtime's slot table.

    Args:
        original: the model's experts module, its routed parameters already stripped; kept
            unregistered (it holds no parameters) and used for its forward and attributes.
        layer: MoE layer index (0..L-1).
        layout: the packed layout of one expert.
        rows: `rows(layer, expert_ids) -> [n, P]` (the pool's gather: device slot or host fallback).
        done: called with `layer` once the experts have computed (the control plane's layer end).
    """

    def __init__(self, original: torch.nn.Module, layer: int, layout: ExpertLayout,
                 rows: Callable[[int, list[int]], torch.Tensor], done: Callable[[int], None]) -> None:
        super().__init__()
        self.check(original)
        object.__setattr__(self, "original", original)  # not a submodule: its state is the runtime's
        self.layer = layer
        self.layout = layout
        self.num_experts = int(original.num_experts)
        self._rows, self._done = rows, done
        self._sig = inspect.signature(original.forward)
        self._index_name = list(self._sig.parameters)[1]

    @staticmethod
    def check(original: torch.nn.Module) -> None:
        """UserError unless `original` looks like a v5 experts module this class can wrap."""
        kind = type(original).__name__
        if not isinstance(original.__dict__.get("num_experts"), int):
            raise UserError(f"{kind} has no integer `num_experts` attribute; this architecture is not supported by the runtime")
        if len(inspect.signature(original.forward).parameters) < 3:
            raise UserError(f"{kind}.forward does not take (hidden_states, indices, weights); not supported by the runtime")

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, original={type(self.original).__name__}"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        bound = self._sig.bind(hidden_states, *args, **kwargs)
        index = bound.arguments[self._index_name]
        hit = torch.unique(index)  # sorted: experts run in the original's order
        if len(hit) and int(hit[-1]) >= self.num_experts:
            raise UserError(f"expert index {int(hit[-1])} >= {self.num_experts}: expert parallelism is not supported")
        ids = hit.tolist()
        params = self.layout.views(self._rows(self.layer, ids))
        bound.arguments[self._index_name] = torch.searchsorted(hit, index).to(index.dtype)
        orig = self.original
        state = orig.__dict__
        try:
            state.update(params)  # plain attributes shadow nothing: the parameters were deleted
            state["num_experts"] = len(ids)
            out = type(orig).forward(orig, *bound.args, **bound.kwargs)
        finally:
            for name in params:
                state.pop(name, None)
            state["num_experts"] = self.num_experts
        self._done(self.layer)
        return out

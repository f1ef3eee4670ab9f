"""The experts module the runtime puts in place of each MoE block's `experts`.

transformers v5 stores a layer's routed experts as parameters stacked over E (which ones, per
family, is the architecture adapter's: `seqmoe.arch`). The runtime packs one expert's slices of
all of them into one contiguous row of P numbers (`seqmoe.arch.ExpertLayout`), so that one copy
moves one expert, and deletes the parameters.

`OffloadedExperts.forward` has the original signature (hidden_states, top_k_index, top_k_weights)
and hands the call to the engine that runs it (given by `offload`): a decode step that posts its
routing (`control="thread"`) to `posted.experts.posted_forward`, every other call to
`eager.experts.eager_forward`. Both find the routed experts' weights through the layer's
`ExpertFront` (or the posted gather) and run the *original module's own forward* on them with the
routed ids renumbered (`compute`), so every architecture's math (activation, gate/up layout,
biases, GPT-OSS's clamp and alpha, whichever `experts_implementation` the config selects) is the
original's, on the same numbers in the same order: outputs are bit-identical on CPU.
docs/decode.md tells where this sits in a decode step.
"""

from __future__ import annotations

import inspect

import torch

from seqmoe.arch import check_experts, experts_implementation
from seqmoe.runtime.core.front import Counts, ExpertFront


class OffloadedExperts(torch.nn.Module):
    """Drop-in `experts` submodule that reads its weights through the runtime's slot table.

    Args:
        original: the model's experts module, its routed parameters already stripped; kept
            unregistered (it holds no parameters) and used for its forward and attributes.
        layer: MoE layer index (0..L-1).
        layout: the packed layout of one expert.
        pool: the runtime's `ExpertPool` (slot table, slots, host blocks).
        control: the `Controller`: `experts_done(layer)` once the experts have computed (the
            control plane's layer end); `posting` tells a decode step that posts its routing.
        host: the `HostExecutor` when misses may be computed on the host CPU, else None.
        twins: the `eager.twins.TwinStore` of the twin miss path, else None.
        eager: the engine function of every call but posted decode steps (`eager.experts.eager_forward`).
        posted: that of posted decode steps (`posted.experts.posted_forward`), or None under inline control.

    `host_s` accumulates the seconds spent here outside the original forward and the gathers (and
    in `done`); `gather_s` the seconds of the gathers (data plane: copies of the routed rows).
    """

    def __init__(self, original: torch.nn.Module, layer: int, layout, pool, control, host=None, twins=None, *,
                 eager, posted=None) -> None:
        super().__init__()
        check_experts(original)
        object.__setattr__(self, "original", original)  # not a submodule: its state is the runtime's
        object.__setattr__(self, "pool", pool)
        self.layer = layer
        self.layout = layout
        self.num_experts = int(original.num_experts)
        self.control = control
        self.host = host
        object.__setattr__(self, "twins", twins)  # not a submodule: shared by every layer
        self.host_clone = host.clone(original) if host is not None else None  # the host executor's copy of `original`
        self.done = control.experts_done
        object.__setattr__(self, "counts", Counts())  # plain object: hot-path updates skip Module.__setattr__
        object.__setattr__(self, "front", ExpertFront(original, layer, layout, pool, self.counts))
        object.__setattr__(self, "skip", None)  # [K] bool during a relayed call: positions the host computes
        object.__setattr__(self, "host_rows", None)  # [B x K] during a relayed call with a disk tier: host-cache rows
        object.__setattr__(self, "twin_part", None)  # during a relayed call: ([B x K] twin positions, routed weights)
        self._sig = inspect.signature(original.forward)
        self._index_name = list(self._sig.parameters)[1]
        self.posted_forward = type(original).forward
        if experts_implementation(original) == "grouped_mm" and pool.device.type == "cuda" and \
                layout.compute_dtype != torch.bfloat16:
            # torch's grouped_mm serves only bf16 on the GPU itself; other dtypes take a fallback that
            # copies the group offsets to the host, which a CUDA graph cannot hold. The K gathered
            # rows are one expert per (token, k): batched_mm is the same products without it.
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # transformers, triton: only when this runs

            self.posted_forward = ALL_EXPERTS_FUNCTIONS["batched_mm"]
        self._eager, self._posted = eager, posted
        self._posted_index: dict[tuple, torch.Tensor] = {}

    host_s = property(lambda self: self.counts.host_s - self.counts.gather_s,
                      doc="Seconds spent here outside the original forward and the gathers.")
    gather_s = property(lambda self: self.counts.gather_s, doc="Seconds spent gathering rows (`ExpertPool.rows`).")
    slot_calls = property(lambda self: self.counts.slot_calls, doc="Calls served in place from a window of slots.")
    gather_calls = property(lambda self: self.counts.gather_calls, doc="Calls served from gathered rows.")
    posted_calls = property(lambda self: self.counts.posted_calls, doc="Decode calls served on the device (posting steps).")

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, original={type(self.original).__name__}"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return (self._posted if self.control.posting else self._eager)(self, hidden_states, *args, **kwargs)

    def routed(self, args: tuple, kwargs: dict, hidden_states: torch.Tensor):
        """(the routed ids of the call, its bound arguments or None for the usual positional call)."""
        if len(args) == 2 and not kwargs:  # the usual call: (hidden_states, top_k_index, top_k_weights)
            return args[0], None
        bound = self._sig.bind(hidden_states, *args, **kwargs)
        return bound.arguments[self._index_name], bound

    def with_index(self, args: tuple, kwargs: dict, bound, index: torch.Tensor) -> tuple[tuple, dict]:
        """The call's (args, kwargs) with the routed ids replaced by `index`."""
        if bound is None:
            return (index, args[1]), kwargs
        bound.arguments[self._index_name] = index
        return bound.args[1:], bound.kwargs

    def posted_index(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, K] the routed positions renumbered into the B x K gathered rows, [B x K] bool: the
        positions whose expert an earlier position routes too, or None at B = 1). Each such position
        reads its expert's first gathered row, and its own is not gathered: an expert several rows
        route is read once per step. Device ops of static shapes only (a captured step replays them)."""
        b, k = index.shape[0], index.shape[-1]
        key = (b * k, index.dtype, index.device)
        at = self._posted_index.get(key)
        if at is None:
            at = self._posted_index[key] = torch.arange(b * k, dtype=index.dtype, device=index.device)
        if b == 1:  # top-k ids differ
            return at.view(b, k), None
        rows = first_positions(index.reshape(-1), at)
        return rows.view(b, k), rows != at

    def compute(self, params: dict, n: int, hidden_states: torch.Tensor, args: tuple, kwargs: dict,
                forward=None) -> torch.Tensor:
        """The original forward (or `forward`, of the same signature) on `params`, views of n packed experts."""
        orig = self.original
        state = orig.__dict__
        try:
            state.update(params)  # plain attributes shadow nothing: the parameters were deleted
            state["num_experts"] = n
            return (forward or type(orig).forward)(orig, hidden_states, *args, **kwargs)
        finally:
            for name in params:
                state.pop(name, None)
            state["num_experts"] = self.num_experts


def first_positions(ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """[n]: for each position of `ids` [n], the first position holding the same id (`at`: arange(n))."""
    order_ids, order = torch.sort(ids, stable=True)
    starts = torch.ones_like(order_ids, dtype=torch.bool)
    starts[1:] = order_ids[1:] != order_ids[:-1]
    first = order[torch.where(starts, at, 0).cummax(0).values]  # per sorted position: its id's first position
    return torch.empty_like(at).scatter_(0, order, first)

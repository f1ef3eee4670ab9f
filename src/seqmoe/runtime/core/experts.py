"""The experts module the runtime puts in place of each MoE block's `experts`.

transformers v5 stores a layer's routed experts as parameters stacked over E (which ones, per
family, is the architecture adapter's: `seqmoe.arch`). The runtime packs one expert's slices of
all of them into one contiguous row of P numbers (`seqmoe.arch.ExpertLayout`), so that one copy
moves one expert, and deletes the parameters.

`OffloadedExperts.forward` has the original signature (hidden_states, top_k_index, top_k_weights).
In a decode step that posts its routing (`control="thread"`: no host synchronisation, capturable
as a CUDA graph) it gathers the K routed rows on the device, each from its slot or, on a miss, from
the mapped host block (`ExpertPool.gather_posted`), and runs the original forward on them with the
routed ids replaced by 0..K-1: static shapes, no host value read; the experts the memory manager
sends to the host CPU run there meanwhile, at weight 0 here, their sum added (`host_relay`).
Otherwise, when every routed expert is in a published slot and the implementation does not depend
on expert numbering (grouped_mm, batched_mm: the default), it can run the *original module's own forward* on
views of a window of at most E pool slots with the routed ids replaced by slot offsets: no copy
(on CUDA, or on the CPU for experts of 1 MiB or more; `CPU_IN_PLACE_BYTES`). Otherwise it gathers
the rows of the routed experts (from the device pool when resident, else from the host block:
`ExpertPool.rows`), views them as compact [n, ...] parameters, renumbers the routed ids to 0..n-1
(order kept) and runs the original forward with those. Every architecture's math (activation,
gate/up layout, biases, GPT-OSS's clamp and alpha, whichever `experts_implementation` the config
selects) is therefore the original's, on the same numbers in the same order: outputs are
bit-identical on CPU.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable

import numpy as np
import torch

from seqmoe.arch import ExpertLayout, check_experts, experts_implementation
from seqmoe.errors import UserError


CPU_IN_PLACE_BYTES = 1 << 20
"""On the CPU, experts smaller than this are gathered even when the window path could run: the CPU
grouped_mm pays a fixed cost per group (about 1 us), which over a window of E groups exceeds copying
the K routed experts when they are small (seqmoe-tiny: 150 kB experts, 3-5% faster gathered);
copying grows with the expert size, the window does not. On CUDA the window path always runs."""


class _Counts:
    __slots__ = ("host_s", "gather_s", "slot_calls", "gather_calls", "posted_calls", "row_version", "row_start")

    def __init__(self) -> None:
        self.host_s, self.gather_s, self.slot_calls, self.gather_calls, self.posted_calls = 0.0, 0.0, 0, 0, 0
        self.row_version, self.row_start = -1, -1  # table version checked; first slot of an in-order layer, or -1


SLOT_INDEXED = frozenset({"grouped_mm", "batched_mm"})
"""transformers experts implementations whose output does not depend on how the experts are numbered
(each (token, k) product is computed alone and summed over k in routing order); they can run on the
whole pool with the routed ids replaced by slot numbers."""


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

    Three paths, all exact:
    - posted (a posting decode step, one position, an implementation in `SLOT_INDEXED`): the K
      routed rows gathered on the device from slot or mapped host block, ids replaced by 0..K-1;
    - by slot (no copy; `by_slot`, see `CPU_IN_PLACE_BYTES`): when every routed expert of the call
      is published in the pool, their slots span at most E (the pool's home-slot layout keeps a
      layer's experts together; at full residency slot = uid) and the implementation is in
      `SLOT_INDEXED`, the original forward runs on views of that window of the pool with each
      routed id replaced by its slot offset;
    - gathered: otherwise the routed experts' rows are gathered (`ExpertPool.rows`: slot or host
      block), viewed as compact [n, ...] parameters and the ids renumbered 0..n-1 (order kept, so
      the eager implementation, whose per-token sum follows expert order, adds in the same order).
    `host_s` accumulates the seconds spent here outside the original forward and the gathers (and
    in `done`); `gather_s` the seconds of the gathers (data plane: copies of the routed rows).
    """

    def __init__(self, original: torch.nn.Module, layer: int, layout: ExpertLayout, pool, control, host=None) -> None:
        super().__init__()
        check_experts(original)
        object.__setattr__(self, "original", original)  # not a submodule: its state is the runtime's
        object.__setattr__(self, "pool", pool)
        self.layer = layer
        self.layout = layout
        self.num_experts = int(original.num_experts)
        self._control = control
        self._host = host  # the `HostExecutor` when misses may be computed on the host CPU
        self._twin = host.twin(original) if host is not None else None
        self._done: Callable[[int], None] = control.experts_done
        self._posted_index: dict[tuple, torch.Tensor] = {}
        self._sig = inspect.signature(original.forward)
        self._index_name = list(self._sig.parameters)[1]
        impl = experts_implementation(original)
        self.slot_ok = impl in SLOT_INDEXED
        self._posted_forward = type(original).forward
        if impl == "grouped_mm" and pool.device.type == "cuda" and layout.dtype != torch.bfloat16:
            # torch's grouped_mm serves only bf16 on the GPU itself; other dtypes take a fallback that
            # copies the group offsets to the host, which a CUDA graph cannot hold. The K gathered
            # rows are one expert per (token, k): batched_mm is the same products without it.
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            self._posted_forward = ALL_EXPERTS_FUNCTIONS["batched_mm"]
        self.by_slot = self.slot_ok and (pool.device.type != "cpu" or layout.expert_bytes >= CPU_IN_PLACE_BYTES)
        self._slot_params = layout.views(pool.pool) if self.slot_ok else None
        self._host_only_posting = pool.device.type == "cuda"
        self._table = pool.table[layer]
        self._table_np = pool.table_host[layer] if pool.device.type == "cpu" else None  # same memory
        self._windows: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._arange = np.arange(self.num_experts, dtype=np.int32)
        object.__setattr__(self, "_c", _Counts())  # plain object: hot-path updates skip Module.__setattr__
        object.__setattr__(self, "_skip", None)  # [K] bool during a relayed call: positions the host computes

    host_s = property(lambda self: self._c.host_s - self._c.gather_s,
                      doc="Seconds spent here outside the original forward and the gathers.")
    gather_s = property(lambda self: self._c.gather_s, doc="Seconds spent gathering rows (`ExpertPool.rows`).")
    slot_calls = property(lambda self: self._c.slot_calls, doc="Calls served in place from a window of slots.")
    gather_calls = property(lambda self: self._c.gather_calls, doc="Calls served from gathered rows.")
    posted_calls = property(lambda self: self._c.posted_calls, doc="Decode calls served on the device (posting steps).")

    def _by_slot(self, index: torch.Tensor) -> tuple[dict | None, int, torch.Tensor | None]:
        """(views of the pool window, its width, routed ids as offsets in it), or (None, 0, None) when
        some routed expert is not published or the window would be wider than E."""
        c, version = self._c, self.pool.version  # version read before the table: a later change is seen next call
        if version != c.row_version:
            row = self.pool.table_host[self.layer]
            s0 = int(row[0])
            c.row_version, c.row_start = version, s0 if s0 >= 0 and (row == s0 + self._arange).all() else -1
        if c.row_start >= 0:  # the whole layer sits in slots s0..s0+E-1 in order: ids are the offsets
            if index.shape[0] > 1 and int(index.max()) >= self.num_experts:  # one position: checked by the controller
                raise UserError(f"an expert index >= {self.num_experts} was routed: expert parallelism is not supported")
            params = self._windows.get((c.row_start, -1))
            if params is None:
                lo, hi = c.row_start, c.row_start + self.num_experts
                params = self._windows[(lo, -1)] = {k: v[lo:hi] for k, v in self._slot_params.items()}
            self._count_slot_call(index)
            return params, self.num_experts, index
        if self._table_np is not None:  # CPU: numpy on a handful of ids is cheaper than torch ops
            try:
                slots = self._table_np[index.numpy()]
            except IndexError:
                slots = None
        else:
            try:
                slots = self._table[index]
            except IndexError:
                slots = None
        if slots is None:
            raise UserError(f"an expert index >= {self.num_experts} was routed: expert parallelism is not supported")
        if self._table_np is not None:
            flat = slots.ravel().tolist()
            lo, hi = min(flat), max(flat)
        else:
            lo, hi = (int(x) for x in torch.aminmax(slots))
        if lo < 0 or hi - lo >= self.num_experts:
            return None, 0, None
        params = self._windows.get((lo, hi))
        if params is None:
            if len(self._windows) >= 4096:
                self._windows.clear()
            params = self._windows[(lo, hi)] = {k: v[lo:hi + 1] for k, v in self._slot_params.items()}
        if self._table_np is not None:
            new_index = torch.from_numpy((slots - lo).astype(np.int64)).to(index.dtype)
        else:
            new_index = (slots - lo).to(index.dtype)
        self._count_slot_call(index)
        return params, hi - lo + 1, new_index

    def _posted(self, index: torch.Tensor) -> tuple[dict, int, torch.Tensor]:
        """A posting decode step: (views of the K gathered rows, K, ids 0..K-1 in routing order)."""
        k = index.shape[-1]
        rows = self.pool.gather_posted(self.layer, index.reshape(-1), self._skip)
        key = (k, index.dtype, index.device)
        new_index = self._posted_index.get(key)
        if new_index is None:
            new_index = self._posted_index[key] = torch.arange(k, dtype=index.dtype, device=index.device).view(1, k)
        self._c.posted_calls += 1
        return self.layout.views(rows), k, new_index

    def _split(self, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
               on_host: frozenset[int]) -> torch.Tensor:
        """One position whose routed experts `on_host` the host executor computes (`host_exec`) while
        the others run here, gathered from slots or host rows; the two partial sums added."""
        flat = index.view(-1).tolist()
        host_ids = sorted({e for e in flat if e in on_host})
        here = sorted({e for e in flat if e not in on_host})
        future = self._host.submit(self._twin, self.layout, self.pool.hosts[self.layer], host_ids,
                                   hidden_states, index, weights)
        out = None
        if here:
            tg = time.perf_counter()
            rows = self.pool.rows(self.layer, here)
            self._c.gather_s += time.perf_counter() - tg
            pos = {e: i for i, e in enumerate(here)}  # the host's experts: expert 0 here, at weight 0 (see host_exec)
            new_index = torch.tensor([pos.get(e, 0) for e in flat], dtype=index.dtype,
                                     device=index.device).view_as(index)
            keep = torch.tensor([e in pos for e in flat], device=weights.device).view(weights.shape[0], -1)
            weights = torch.where(keep, weights, 0)
            orig = self.original
            state, params = orig.__dict__, self.layout.views(rows)
            try:
                state.update(params)
                state["num_experts"] = len(here)
                out = type(orig).forward(orig, hidden_states, new_index, weights)
            finally:
                for name in params:
                    state.pop(name, None)
                state["num_experts"] = self.num_experts
            self._c.gather_calls += 1
        host_out = future.result().to(hidden_states.device)
        return host_out if out is None else out + host_out

    def _count_slot_call(self, index: torch.Tensor) -> None:
        """One call served in place: its distinct experts count as pool reads."""
        self.pool.pool_reads += index.shape[-1] if index.shape[0] == 1 else len(set(index.view(-1).tolist()))
        self._c.slot_calls += 1

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, original={type(self.original).__name__}"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        relay = self._control.relay
        if (relay is not None and self._control.posting and relay.active and len(args) == 2 and not kwargs
                and args[0].shape[0] == 1):
            return self._relayed(relay, hidden_states, *args)
        return self._forward(hidden_states, *args, **kwargs)

    def _relayed(self, relay, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A posting decode step with the host path (`host_relay`): the positions the host computes
        run here at weight 0 on zero rows (an exact 0 added), the host's sum is added to the rest."""
        t0 = time.perf_counter()
        weights, skip = relay.enter(self.layer, hidden_states, index, weights)
        object.__setattr__(self, "_skip", skip)
        t1 = time.perf_counter()
        try:
            out = self._forward(hidden_states, index, weights)
        finally:
            object.__setattr__(self, "_skip", None)
        t2 = time.perf_counter()
        out = relay.leave(self.layer, out)
        self._c.host_s += (t1 - t0) + (time.perf_counter() - t2)
        return out

    def _forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        t0 = time.perf_counter()
        if len(args) == 2 and not kwargs:  # the usual call: (hidden_states, top_k_index, top_k_weights)
            index, bound = args[0], None
        else:
            bound = self._sig.bind(hidden_states, *args, **kwargs)
            index = bound.arguments[self._index_name]
        params = None
        if self._host is not None and bound is None and index.shape[0] == 1:
            on_host = self._control.host_experts(self.layer)
            if on_host:
                out = self._split(hidden_states, index, args[1], on_host)
                self._done(self.layer)
                self._c.host_s += time.perf_counter() - t0
                return out
        posted = self._control.posting and self.slot_ok and index.shape[0] == 1
        if posted:
            params, n, new_index = self._posted(index)
        elif self.by_slot:
            params, n, new_index = self._by_slot(index)
        if params is None:
            hit = torch.unique(index)  # sorted: experts run in the original's order
            if len(hit) and int(hit[-1]) >= self.num_experts:
                raise UserError(f"expert index {int(hit[-1])} >= {self.num_experts}: expert parallelism is not supported")
            ids = hit.tolist()
            tg = time.perf_counter()
            # A posting step on CUDA reads no slot the host chose: the slot fence covers device-side
            # table reads only (see `pool`); the host rows are always exact.
            rows = self.pool.rows(self.layer, ids, host_only=self._control.posting and self._host_only_posting)
            self._c.gather_s += time.perf_counter() - tg
            params, n = self.layout.views(rows), len(ids)
            new_index = torch.searchsorted(hit, index).to(index.dtype)
            self._c.gather_calls += 1
        if bound is None:
            args = (new_index, args[1])
        else:
            bound.arguments[self._index_name] = new_index
            args, kwargs = bound.args[1:], bound.kwargs
        orig = self.original
        state = orig.__dict__
        forward = self._posted_forward if posted else type(orig).forward
        t1 = time.perf_counter()
        try:
            state.update(params)  # plain attributes shadow nothing: the parameters were deleted
            state["num_experts"] = n
            out = forward(orig, hidden_states, *args, **kwargs)
        finally:
            for name in params:
                state.pop(name, None)
            state["num_experts"] = self.num_experts
        t2 = time.perf_counter()
        self._done(self.layer)
        self._c.host_s += (t1 - t0) + (time.perf_counter() - t2)
        return out

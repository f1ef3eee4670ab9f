"""The front of one layer's experts: where the weights of a call's routed experts are read from,
whichever miss path the memory manager chose (in the spirit of mixtral-offloading's expert cache).

    params, n, index = front.weights(index)    # views of n packed experts, routed ids renumbered into them
    rows = front.rows([3, 5])                  # [2, P]: each from its slot, else from its host row

Two ways, both exact:
- by slot (no copy; `by_slot`, see `CPU_IN_PLACE_BYTES`): when every routed expert of the call is
  published in the pool, their slots span at most E (the pool's home-slot layout keeps a layer's
  experts together; at full residency slot = uid) and the implementation is in `SLOT_INDEXED`,
  the original forward runs on views of that window of the pool with each routed id replaced by
  its slot offset;
- gathered: otherwise the routed experts' rows are gathered (`ExpertPool.rows`: the slot when
  published, else the host row, read in place over the link or, on the CPU's emulated link, once
  its queued copy lands), viewed as compact [n, ...] parameters and the ids renumbered 0..n-1
  (order kept, so the eager implementation, whose per-token sum follows expert order, adds in the
  same order).
Experts the manager sent to the host CPU are not read here (`eager.experts`, `posted.experts`).
Where it sits in a decode step: docs/decode.md.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from seqmoe.arch import experts_implementation
from seqmoe.base.errors import UserError

CPU_IN_PLACE_BYTES = 1 << 20
"""On the CPU, experts smaller than this are gathered even when the window path could run: the CPU
grouped_mm pays a fixed cost per group (about 1 us), which over a window of E groups exceeds copying
the K routed experts when they are small (seqmoe-tiny: 150 kB experts, 3-5% faster gathered);
copying grows with the expert size, the window does not. On CUDA the window path always runs."""

SLOT_INDEXED = frozenset({"grouped_mm", "batched_mm"})
"""transformers experts implementations whose output does not depend on how the experts are numbered
(each (token, k) product is computed alone and summed over k in routing order); they can run on the
whole pool with the routed ids replaced by slot numbers."""


class Counts:
    """What the experts module of one layer did, and the seconds it spent (hot path: plain slots)."""

    __slots__ = ("host_s", "gather_s", "slot_calls", "gather_calls", "posted_calls", "row_version", "row_start",
                 "prompt_calls", "prompt_host", "prompt_link")

    def __init__(self) -> None:
        self.host_s, self.gather_s, self.slot_calls, self.gather_calls, self.posted_calls = 0.0, 0.0, 0, 0, 0
        # prompt calls whose missing experts were split; of those experts, computed on the host / read over the link
        self.prompt_calls, self.prompt_host, self.prompt_link = 0, 0, 0
        self.row_version, self.row_start = -1, -1  # table version checked; first slot of an in-order layer, or -1


class ExpertFront:
    """The weights of one layer's routed experts, from the pool's slots or host rows.

    Args:
        original: the layer's experts module (its implementation decides whether slots can be indexed).
        layer: MoE layer index (0..L-1).
        layout: the packed layout of one expert.
        pool: the runtime's `ExpertPool`.
        counts: the layer's `Counts` (calls served, seconds gathering).
    """

    def __init__(self, original: torch.nn.Module, layer: int, layout, pool, counts: Counts) -> None:
        self.layer, self.layout, self.pool, self._c = layer, layout, pool, counts
        self.num_experts = int(original.num_experts)
        self.slot_ok = experts_implementation(original) in SLOT_INDEXED
        self.by_slot = self.slot_ok and layout.in_place and (pool.device.type != "cpu"
                                                             or layout.expert_bytes >= CPU_IN_PLACE_BYTES)
        self._slot_params = layout.views(pool.pool) if self.slot_ok and layout.in_place else None
        self._table = pool.table[layer]
        self._table_np = pool.table_host[layer] if pool.device.type == "cpu" else None  # same memory
        self._windows: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._arange = np.arange(self.num_experts, dtype=np.int32)

    def weights(self, index: torch.Tensor, host_only: bool = False) -> tuple[dict, int, torch.Tensor]:
        """(views of n packed experts, n, `index` renumbered into them) for the routed `index`: a window
        of slots in place when it can (`by_slot`, not `host_only`), else gathered rows; `host_only`:
        every row from its host block (a posting step on CUDA reads no slot the host chose)."""
        if self.by_slot and not host_only:
            params, n, new_index = self._window(index)
            if params is not None:
                return params, n, new_index
        hit = torch.unique(index)  # sorted: experts run in the original's order
        if len(hit) and int(hit[-1]) >= self.num_experts:
            raise UserError(f"expert index {int(hit[-1])} >= {self.num_experts}: expert parallelism is not supported")
        ids = hit.tolist()
        rows = self.rows(ids, host_only=host_only)
        self._c.gather_calls += 1
        return self.layout.views(rows), len(ids), torch.searchsorted(hit, index).to(index.dtype)

    def rows(self, ids: list[int], host_only: bool = False) -> torch.Tensor:
        """[n, P] packed rows of experts `ids` (`ExpertPool.rows`), the seconds counted as gathering."""
        tg = time.perf_counter()
        rows = self.pool.rows(self.layer, ids, host_only=host_only)
        self._c.gather_s += time.perf_counter() - tg
        return rows

    def _window(self, index: torch.Tensor) -> tuple[dict | None, int, torch.Tensor | None]:
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

    def _count_slot_call(self, index: torch.Tensor) -> None:
        """One call served in place: its distinct experts count as pool reads."""
        self.pool.pool_reads += index.shape[-1] if index.shape[0] == 1 else len(set(index.view(-1).tolist()))
        self._c.slot_calls += 1

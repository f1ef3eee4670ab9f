"""The one driver loop: feeds a memory manager position by position and keeps the virtual clock.

Both the simulator (over a recorded trace) and the runtime's control plane (over a live model's
router outputs) make exactly these calls in this order, so their decisions and counts agree:

    driver = Driver(manager)
    for each token:   driver.token_start(token_id, new_request)
        for each MoE layer l:   driver.reveal(l, expert_ids)     # the router chose [K] experts
                                driver.layer_end(l)              # its experts have computed
    counts = driver.finish()

The clock follows the cost model: a token first pays the non-MoE time, each layer its non-expert
time before the reveal and its K experts' time after the experts start (when the manager says
they are all present); experts the manager sent to the host CPU overlap the device's, and the
layer ends when the last output is back.

A decode step of B sequences (docs/DESIGN.md, "Batched decode") makes the same calls with
`step_start(tokens, new_requests, lanes)` in place of `token_start` and [B, K] ids at each reveal:
the manager is told the layer's distinct experts with their multiplicity (counts stay per
activation; each expert is moved and computed once for all its rows), and its predictor keeps one
state per lane (`seqmoe.brain.predict.lanes.LanePredictors`). A position is then (step, layer).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.brain.manager.counts import SimCounts


class Driver:
    """Position-major calls into `manager` (a `MemoryManager` or `CompiledManager`) on a virtual clock."""

    def __init__(self, manager, disk=None) -> None:
        self.manager = manager
        self.disk = disk
        """The disk tier's hooks (`seqmoe.brain.manager.disk_clock.DiskClock`: a host cache in front of the disk,
        series with the transfers); None: every expert in host memory."""
        self.L, self.E, self.K = manager.num_layers, manager.num_experts, manager.top_k
        self.clock = 0.0
        self.tokens = 0  # decode steps whose last layer has ended (positions are numbered by them)
        self.first = 0  # positions are numbered from this token on (a replay of a later request alone)
        self.rows = 0  # tokens decoded: the steps' rows summed (= steps at batch 1)
        self.expert_reads = 0  # (step, layer, expert) triples computed: the layers' distinct experts summed
        self._distinct = self.K  # the current layer's distinct experts
        self._batch = 1  # rows of the current step
        self._replans = manager.replans
        self._base = np.arange(self.L, dtype=np.int64)[:, None] * self.E  # [L, 1] first uid of each layer

    def token_start(self, token_id: int | None, new_request: bool) -> None:
        """A token starts (its id when known); `new_request`: it is the first of a request (batch 1)."""
        if new_request:
            self.manager.begin_request()
        self._batch = 1
        self.clock += self.manager.token_s
        if self.disk is not None:
            self.disk.token_start(self.clock)
        self.manager.token_start((self.first + self.tokens) * self.L, self.clock, token_id)
        if self.disk is not None:
            self.disk.after_token_start()

    def step_start(self, token_ids, new_requests, lanes=None) -> None:
        """A decode step of B = len(token_ids) rows starts: row i is lane `lanes[i]` (default: lane i)
        decoding `token_ids[i]` (None when unknown), the first token of a request when `new_requests[i]`."""
        lanes = list(range(len(token_ids))) if lanes is None else [int(b) for b in lanes]
        if not (len(lanes) == len(token_ids) == len(new_requests) >= 1):
            raise ValueError(f"a step needs one token, request flag and lane per row; got {len(token_ids)}, "
                             f"{len(new_requests)} and {len(lanes)}")
        pred = self.manager.lanes()
        if pred is not None:
            for lane, new in zip(lanes, new_requests):
                if new:
                    pred.begin_request(lane)
            pred.set_rows(lanes)
        self._batch = len(lanes)
        self.clock += self.manager.token_s
        if self.disk is not None:
            self.disk.token_start(self.clock)
        self.manager.token_start((self.first + self.tokens) * self.L, self.clock, list(token_ids))
        if self.disk is not None:
            self.disk.after_token_start()

    def reveal(self, layer: int, ids: np.ndarray, uids=None, weights: np.ndarray | None = None) -> None:
        """Layer `layer` of the current step routed to `ids` ([K] expert ids; [B, K] in a step of B
        rows) with gate `weights` (read by the twin miss path only; [B, K] summed per distinct expert,
        the twin rule of a batch: docs/DESIGN.md, "Low-bit twins on a miss"); `uids`: the same as
        global ids (`layer * E + id`) when the caller has them at hand, in the form the manager takes
        (`takes_arrays`: an int64 array, else a list). The clock moves to when the layer's experts can start."""
        m, mult = self.manager, None
        if uids is None or ids.ndim == 2:
            if int(ids.max()) >= self.E or int(ids.min()) < 0:
                raise UserError(f"an expert index outside 0..{self.E - 1} was routed: expert parallelism is "
                                "not supported")
            if ids.ndim == 2:
                flat = ids.reshape(-1).astype(np.int64) + self._base[layer]
                uids, mult = distinct_uids(flat)
                if weights is not None and m.twin is not None:  # a twin costs its gate weight in every row routing it
                    weights = summed_per_uid(flat, uids, np.asarray(weights, dtype=np.float64).reshape(-1))
            else:
                uids = ids.astype(np.int64) + self._base[layer]
            if not m.takes_arrays:
                uids, mult = uids.tolist(), None if mult is None else mult.tolist()
        self._distinct = len(uids)
        self.expert_reads += self._distinct
        reveal = self.clock + m.non_expert_s
        if self.disk is not None:
            self.disk.before_layer(uids, reveal)
        step = (self.first + self.tokens) * self.L + layer
        self.clock = m.layer(step, uids, ids if m.wants_ids else None, reveal, weights, mult)
        if self.disk is not None:
            self.clock = self.disk.after_layer(m, self.clock)

    def pool_at_reveal(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """([E] missing, [E] readable) experts of `layer` when its router reveals next: neither
        resident nor on their way; resident with their copy done by then."""
        m = self.manager
        lo = layer * self.E
        readable = m.readable_mask(self.clock + m.non_expert_s)[lo:lo + self.E]
        return m.present_mask()[lo:lo + self.E] == 0, readable

    def layer_end(self, layer: int) -> None:
        """Layer `layer`'s experts have computed (after the last layer, the step has ended)."""
        m = self.manager
        if m.host_served:  # the device computes the rest; the layer ends when the host's outputs are back
            end = self.clock + (self._distinct - m.host_served) * m.per_expert_s
            host_end = m.host_end if self.disk is None else self.disk.layer_end(end, m.host_end)
            if host_end > end:
                m.add_stall(host_end - end)
                end = host_end
            self.clock, m.host_served = end, 0
        else:
            self.clock += self._distinct * m.per_expert_s
        if self.disk is not None:
            self.disk.at(self.clock)
        if self._replans:
            self.manager.layer_end((self.first + self.tokens) * self.L + layer, self.clock)
        if layer == self.L - 1:
            self.tokens += 1
            self.rows += self._batch

    def abandon(self) -> None:
        """The current step will not finish (a forward cut short): the next one starts afresh, its
        number taken; its rows count as tokens seen."""
        self.tokens += 1
        self.rows += self._batch

    def counts(self) -> SimCounts:
        """The counts so far, with the run's times (a copy; the manager keeps counting)."""
        m = self.manager
        c = dataclasses.replace(m.c)
        c.time_s, c.copies, c.num_tokens, c.copy_time_s = self.clock, m.copies, self.rows, m.copy_time_s
        c.steps, c.expert_reads = self.tokens, self.expert_reads
        if self.expert_reads == self.tokens * self.L * self.K:  # batch 1: the protocol's formula, as written
            c.full_load_time_s = self.tokens * (m.token_s + self.L * m.layer_s)
        else:  # each layer computes its distinct experts once (docs/DESIGN.md, "Batched decode")
            c.full_load_time_s = self.tokens * (m.token_s + self.L * m.non_expert_s) + self.expert_reads * m.per_expert_s
        c.per_expert_s, c.host_expert_s = m.per_expert_s, m.host_expert_s
        c.twin_bytes = m.twin_bytes
        if self.disk is not None:
            self.disk.fill(c)
        return c

    def finish(self) -> SimCounts:
        """The run ended: queued copies run; the final counts."""
        self.manager.finish()
        return self.counts()


def distinct_uids(uids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values of `uids` in order of first appearance, how often each appears)."""
    values, first, counts = np.unique(uids, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    return values[order], counts[order].astype(np.int64)


def summed_per_uid(flat: np.ndarray, uids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """[len(uids)]: the sum of `weights` over the positions of `flat` holding each of `uids` (every value
    of `flat` is among `uids`)."""
    order = np.argsort(uids, kind="stable")
    at = order[np.searchsorted(uids, flat, sorter=order)]
    return np.bincount(at, weights=weights, minlength=len(uids))

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
"""

from __future__ import annotations

import dataclasses

import numpy as np

from seqmoe.errors import UserError
from seqmoe.manager.counts import SimCounts


class Driver:
    """Position-major calls into `manager` (a `MemoryManager` or `CompiledManager`) on a virtual clock."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.L, self.E, self.K = manager.num_layers, manager.num_experts, manager.top_k
        self.clock = 0.0
        self.tokens = 0  # tokens whose last layer has ended
        self._expert_s = self.K * manager.per_expert_s
        self._replans = manager.replans
        self._base = np.arange(self.L, dtype=np.int64)[:, None] * self.E  # [L, 1] first uid of each layer

    def token_start(self, token_id: int | None, new_request: bool) -> None:
        """A token starts (its id when known); `new_request`: it is the first of a request."""
        if new_request:
            self.manager.begin_request()
        self.clock += self.manager.token_s
        self.manager.token_start(self.tokens * self.L, self.clock, token_id)

    def reveal(self, layer: int, ids: np.ndarray, uids=None, weights: np.ndarray | None = None) -> None:
        """Layer `layer` of the current token routed to `ids` ([K] expert ids) with gate `weights`
        (read by the twin miss path only); `uids`: the same as global ids (`layer * E + id`) when the
        caller has them at hand, in the form the manager takes (`takes_arrays`: an int64 array, else a
        list). The clock moves to when the layer's experts can start."""
        if uids is None:
            if int(ids.max()) >= self.E or int(ids.min()) < 0:
                raise UserError(f"an expert index outside 0..{self.E - 1} was routed: expert parallelism is "
                                "not supported")
            uids = ids.astype(np.int64) + self._base[layer]
            if not self.manager.takes_arrays:
                uids = uids.tolist()
        m = self.manager
        reveal = self.clock + m.non_expert_s
        self.clock = m.layer(self.tokens * self.L + layer, uids, ids if m.wants_ids else None, reveal, weights)

    def pool_at_reveal(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """([E] missing, [E] readable) experts of `layer` when its router reveals next: neither
        resident nor on their way; resident with their copy done by then."""
        m = self.manager
        lo = layer * self.E
        readable = m.readable_mask(self.clock + m.non_expert_s)[lo:lo + self.E]
        return m.present_mask()[lo:lo + self.E] == 0, readable

    def layer_end(self, layer: int) -> None:
        """Layer `layer`'s experts have computed (after the last layer, the token has ended)."""
        m = self.manager
        if m.host_served:  # the device computes the rest; the layer ends when the host's outputs are back
            end = self.clock + (self.K - m.host_served) * m.per_expert_s
            if m.host_end > end:
                m.add_stall(m.host_end - end)
                end = m.host_end
            self.clock, m.host_served = end, 0
        else:
            self.clock += self._expert_s
        if self._replans:
            self.manager.layer_end(self.tokens * self.L + layer, self.clock)
        if layer == self.L - 1:
            self.tokens += 1

    def counts(self) -> SimCounts:
        """The counts so far, with the run's times (a copy; the manager keeps counting)."""
        m = self.manager
        c = dataclasses.replace(m.c)
        c.time_s, c.copies, c.num_tokens, c.copy_time_s = self.clock, m.copies, self.tokens, m.copy_time_s
        c.full_load_time_s = self.tokens * (m.token_s + self.L * m.layer_s)
        c.per_expert_s, c.host_expert_s = m.per_expert_s, m.host_expert_s
        c.twin_bytes = m.twin_bytes
        return c

    def finish(self) -> SimCounts:
        """The run ended: queued copies run; the final counts."""
        self.manager.finish()
        return self.counts()

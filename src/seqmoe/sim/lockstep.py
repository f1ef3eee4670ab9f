"""The batch extension of the protocol (docs/DESIGN.md, "Batched decode"): a trace's requests
decoded B at a time in lockstep, a finished request's lane taken by the next request in file order.

    plan = lockstep(trace, batch=8)       # plan.rows[s, b]: the trace token lane b decodes at step s (-1: idle)
    uids = plan.uids(trace)               # [S, L, W] each step-layer's distinct experts (padded by repeats)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqmoe.trace.schema import RoutingTrace


@dataclass(frozen=True)
class Lockstep:
    """Which trace token each lane decodes at each step."""

    rows: np.ndarray
    """[S, B] int64: the trace token lane b decodes at step s; -1 when the lane is idle (no request left)."""
    new: np.ndarray
    """[S, B] bool: that token is the first of its request."""

    @property
    def batch(self) -> int:
        return self.rows.shape[1]

    @property
    def num_steps(self) -> int:
        return self.rows.shape[0]

    def uids(self, trace: RoutingTrace) -> np.ndarray:
        """[S, L, W] int64: each step-layer's experts over its rows, each expert once (first appearance
        order), padded to the widest by repeating the last: the access sequence of the batched run
        (a repeated access is a hit for any policy, so Belady's count and the oracles see the sets)."""
        tok = trace.uids()  # [T, L, K]
        S, L, K = self.num_steps, trace.num_layers, trace.top_k
        sets = [[None] * L for _ in range(S)]
        width = K
        for s in range(S):
            live = self.rows[s][self.rows[s] >= 0]
            for l in range(L):
                flat = tok[live, l].reshape(-1)
                _, first = np.unique(flat, return_index=True)
                sets[s][l] = flat[np.sort(first)]
                width = max(width, len(sets[s][l]))
        out = np.empty((S, L, width), dtype=np.int64)
        for s in range(S):
            for l in range(L):
                d = sets[s][l]
                out[s, l, :len(d)] = d
                out[s, l, len(d):] = d[-1]
        return out


def lockstep(trace: RoutingTrace, batch: int) -> Lockstep:
    """The lockstep schedule of `trace` at `batch` lanes: lanes take requests in file order as they
    free (lowest lane first); a request's tokens run one per step; a lane whose request ended takes
    the next one at the next step."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    off = trace.request_offsets
    queue = list(range(len(off) - 1))[::-1]  # requests left, next at the end
    cur = [-1] * batch  # the token each lane decodes next, -1: none
    end = [0] * batch
    rows, new = [], []
    while True:
        row, first = [-1] * batch, [False] * batch
        for b in range(batch):
            if cur[b] < 0 and queue:
                r = queue.pop()
                cur[b], end[b] = int(off[r]), int(off[r + 1])
                first[b] = True
            if cur[b] >= 0:
                row[b] = cur[b]
                cur[b] += 1
                if cur[b] == end[b]:
                    cur[b] = -1
        if all(x < 0 for x in row):
            break
        rows.append(row)
        new.append(first)
    return Lockstep(np.asarray(rows, dtype=np.int64).reshape(-1, batch), np.asarray(new, dtype=bool).reshape(-1, batch))

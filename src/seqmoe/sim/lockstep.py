"""The batch extension of the protocol (docs/DESIGN.md, "Batched decode"): a trace's requests
decoded B at a time in lockstep, a finished request's lane taken by the next request in file order.

    plan = lockstep(trace, batch=8)       # plan.rows[s, b]: the trace token lane b decodes at step s (-1: idle)
    uids = plan.uids(trace)               # [S, L, W] each step-layer's distinct experts (padded by repeats)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqmoe.brain.admission import ADMISSIONS, CANDIDATES, MAX_SKIPS
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


def lockstep(trace: RoutingTrace, batch: int, admission: str = "fifo", max_skips: int = MAX_SKIPS) -> Lockstep:
    """The lockstep schedule of `trace` at `batch` lanes: lanes take requests as they free (lowest
    lane first); a request's tokens run one per step; a lane whose request ended takes the next one
    at the next step.

    `admission` "fifo": requests in file order. "overlap" (ExpertFlow's cache-aware routing read for
    batches): among the first `CANDIDATES` waiting, the one whose first token's experts overlap most,
    summed over layers, with those of the running lanes' latest step (in the runtime, a request's
    routing is known once its prompt has run; the first token stands in for it here, as traces hold
    no prompts); ties and an empty batch go FIFO, and the head of the queue is passed over at most
    `max_skips` times (the fairness bound). The schedule reads the trace only, so every system
    replays the same one."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    if admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
    off = trace.request_offsets
    queue = list(range(len(off) - 1))  # requests waiting, file order
    skips = 0  # times the head of the queue was passed over
    first_sets = trace.expert_ids[off[:-1]] if admission == "overlap" else None  # [R, L, K]
    cur = [-1] * batch  # the token each lane decodes next, -1: none
    end = [0] * batch
    rows, new = [], []
    while True:
        row, first = [-1] * batch, [False] * batch
        for b in range(batch):
            if cur[b] < 0 and queue:
                live = [t for t in rows[-1] if t >= 0] if rows else []
                pick = _overlap_pick(trace, queue, first_sets, live) if first_sets is not None and live else 0
                if pick > 0 and skips >= max_skips:
                    pick = 0
                skips = 0 if pick == 0 else skips + 1
                r = queue.pop(pick)
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


def _overlap_pick(trace: RoutingTrace, queue: list[int], first_sets: np.ndarray, live: list[int]) -> int:
    """Index in `queue` (among its first `CANDIDATES`) of the request whose first token's experts share
    the most (layer, expert) pairs with the tokens `live` of the running lanes; the first on ties."""
    E = trace.num_experts
    running = np.zeros((trace.num_layers, E), dtype=bool)
    for t in live:
        np.put_along_axis(running, trace.expert_ids[t].astype(np.int64), True, axis=1)
    cands = np.asarray(queue[:CANDIDATES])
    hits = np.take_along_axis(running[None].repeat(len(cands), 0), first_sets[cands].astype(np.int64), axis=2)
    return int(np.argmax(hits.sum(axis=(1, 2))))

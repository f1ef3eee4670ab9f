"""Which waiting request takes a free row of the running batch (`seqmoe serve --admission`).

    admission = Admission("overlap", model, runtime, max_batch=4)   # hooks the model's routers (overlap only)
    i = admission.pick(waiting, running_lanes)                        # index in `waiting` of the job to admit
    admission.observe(input_ids, lanes)                               # after each forward: what it routed
    admission.close()                                                 # hooks off

`fifo` (the default) admits the oldest request. `overlap` (ExpertFlow's cache-aware routing read for
batches, the simulator's rule of `seqmoe.sim.lockstep`, same names and bounds: `seqmoe.brain.admission`): among the first
`CANDIDATES` waiting, the request whose forecast routing shares the most (layer, expert) pairs with
the running rows' latest routing plus the experts resident in the pool; ties and an empty batch go
FIFO, and the head of the queue is passed over at most `MAX_SKIPS` times in a row (the fairness bound).

The forecast needs no model run: before a request runs the server knows its prompt tokens only, so
it is the routing the server saw each of those tokens take last (any request's prompt or decode
step; router forward hooks record it), averaged over the prompt's known tokens: per (layer, expert),
the expected share of the prompt's activations. Routing is largely a function of the token id, and
the table costs one [L, K] row per distinct token seen. Unknown tokens forecast nothing (overlap 0).
Admission only reorders requests; it never changes a request's tokens.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from seqmoe.arch import moe_layers, unpack_router_output
from seqmoe.base.errors import UserError
from seqmoe.brain.admission import ADMISSIONS, CANDIDATES, MAX_SKIPS

__all__ = ["ADMISSIONS", "CANDIDATES", "MAX_SKIPS", "Admission", "overlap_choice"]


def overlap_choice(forecasts: np.ndarray, target: np.ndarray) -> int:
    """Index of the candidate whose forecast puts the most mass on `target`; the first on ties.

    Args:
        forecasts: [C, L * E] float, per candidate the expected activations per (layer, expert) uid.
        target: [L * E] bool, the running rows' latest experts and the resident ones.
    """
    return int(np.argmax(forecasts @ target.astype(forecasts.dtype)))


class Admission:
    """The admission rule of one batcher, and what the overlap rule learns of the routing (module doc).

    Args:
        rule: one of `ADMISSIONS`.
        model: the served model (its routers are hooked under `overlap` with `max_batch` > 1).
        runtime: its `OffloadRuntime` (the pool's resident experts), or None (fully loaded: none).
        max_batch: the batcher's batch size; at 1 a free row finds the batch empty, so FIFO.
    """

    def __init__(self, rule: str, model, runtime, max_batch: int) -> None:
        if rule not in ADMISSIONS:
            raise UserError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {rule!r}")
        self.rule, self.runtime = rule, runtime
        self.skips = 0  # admissions in a row that passed the head of the queue over
        self.reordered = 0  # admissions that did
        self.admitted, self._wait_sum, self._wait_max = 0, 0.0, 0.0
        self._hooks, self._ids = [], []
        self._table: dict[int, np.ndarray] = {}  # token id -> [L, K] int64 the routing it took last
        self._lane: dict[int, np.ndarray] = {}  # lane -> [L, K] int64 routing of its latest position
        if rule == "overlap" and max_batch > 1:
            layers = moe_layers(model)
            self.L, self.E = len(layers), layers[0].num_experts
            self._ids = [None] * self.L

            def hook(layer: int):
                def keep(module, args, output):  # a reference only: read once after the forward
                    self._ids[layer] = unpack_router_output(module, output)[2]
                return keep

            self._hooks = [m.router.register_forward_hook(hook(i)) for i, m in enumerate(layers)]

    def observe(self, input_ids: torch.Tensor, lanes: list[int]) -> None:
        """A forward over `input_ids` [B, N] (row b on lane `lanes[b]`) ran: each position's routing
        becomes its token's entry, and each lane's last position its latest routing."""
        if not self._hooks or any(x is None or x.shape[0] != input_ids.numel() for x in self._ids):
            return
        B, N = input_ids.shape
        ids = torch.stack(self._ids).cpu().numpy().astype(np.int64).reshape(self.L, B, N, -1)  # [L, B, N, K]
        self._ids = [None] * self.L
        for b, (row, lane) in enumerate(zip(input_ids.tolist(), lanes)):
            for n, token in enumerate(row):
                self._table[token] = ids[:, b, n]
            self._lane[lane] = ids[:, b, -1]

    def pick(self, waiting, lanes: list[int]) -> int:
        """Index in `waiting` (jobs, oldest first, non-empty) of the job to admit next, with the
        running batch's rows on `lanes`; counts it as admitted."""
        choice = 0
        if self._hooks and lanes and len(waiting) > 1:
            cands = list(waiting)[:CANDIDATES]
            target = self._target(lanes)
            choice = overlap_choice(np.stack([self.forecast(j.prompt_ids) for j in cands]), target)
        if choice > 0 and self.skips >= MAX_SKIPS:
            choice = 0
        self.skips = 0 if choice == 0 else self.skips + 1
        self.reordered += choice > 0
        wait = time.monotonic() - waiting[choice].submitted
        self.admitted, self._wait_sum, self._wait_max = self.admitted + 1, self._wait_sum + wait, max(self._wait_max, wait)
        return choice

    def forecast(self, prompt_ids: list[int]) -> np.ndarray:
        """[L * E] float64: the prompt's expected activations per (layer, expert) uid, averaged over
        its tokens of known routing (zeros when none is known)."""
        tokens, counts = np.unique(np.asarray(prompt_ids, dtype=np.int64), return_counts=True)
        known = [(self._table[t], c) for t, c in zip(tokens.tolist(), counts.tolist()) if t in self._table]
        out = np.zeros(self.L * self.E)
        if not known:
            return out
        rows = np.stack([r for r, _ in known])  # [U, L, K]
        weight = np.asarray([c for _, c in known], dtype=np.float64)
        uids = rows + (np.arange(self.L) * self.E)[None, :, None]
        np.add.at(out, uids.reshape(len(known), -1), weight[:, None])
        return out / weight.sum()

    def _target(self, lanes: list[int]) -> np.ndarray:
        """[L * E] bool: the running lanes' latest experts, and those resident in the pool."""
        target = np.zeros((self.L, self.E), dtype=bool)
        if self.runtime is not None:
            target |= self.runtime.pool.table_host >= 0
        for lane in lanes:
            if lane in self._lane:
                np.put_along_axis(target, self._lane[lane], True, axis=1)
        return target.reshape(-1)

    def counts(self) -> dict:
        return {"admission": self.rule, "reordered": self.reordered,
                "mean_wait_s": self._wait_sum / self.admitted if self.admitted else 0.0, "max_wait_s": self._wait_max}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

"""Probabilistic Belady: evict the expert whose forecast next use is furthest away or least likely.

Belady's rule evicts the expert used furthest in the future. With a forecast instead of the future,
each uid gets a *keep value*: the expected discount of its next use,

    keep(u) = E[exp(-(next_use(u) - now) / tau)],

computed from the forecast rows of u's layer (the first use at row h has probability
p_h * prod_{h' < h} (1 - p_h'), independence assumed) and, past the last forecast position, from a
prior: u is used by each later token of its layer with its training rate q_u (a geometric wait).
With a certain forecast (one-hot rows) the keep value is exp(-distance / tau), so the policy evicts
exactly what Belady evicts whenever the victim's next use lies within the horizon; every use
beyond the horizon is worth less than any certain use within it. Without a forecast the policy is
frequency-based, weighted by how soon the expert's layer comes. Ties go to the least recently used.

    policy = ForecastPolicy.from_trace(train)
    policy.update(forecast, step)        # whenever a forecast arrives (the scheduler calls it)
    policy.keep_value(uids) -> [N]        # any uids, resident or not

The values are cached per (forecast, current position); `victim` is a few vectorised passes over
the L * E uids.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import numpy as np

from seqmoe.predict.base import Forecast
from seqmoe.trace.schema import RoutingTrace


class ForecastPolicy:
    """Evict the resident, unpinned uid with the lowest keep value (ties: least recently used).

    Args:
        use_rate: [L * E] float, probability that a token uses each uid (training counts / T).
        num_layers: L.
        num_experts: E.
        tau: discount scale in positions (a use `tau` positions later is worth 1/e of one now);
            defaults to two tokens (2 L).
    """

    def __init__(self, use_rate: np.ndarray, *, num_layers: int, num_experts: int, tau: float | None = None) -> None:
        self._L, self._E = num_layers, num_experts
        q = np.clip(np.asarray(use_rate, dtype=np.float64).reshape(-1), 1e-6, 1.0)
        if len(q) != num_layers * num_experts:
            raise ValueError(f"use_rate has {len(q)} entries, expected L * E = {num_layers * num_experts}")
        self.tau = float(tau) if tau is not None else 2.0 * num_layers
        r = np.exp(-num_layers / self.tau)  # discount of one token
        # E[r^G] for G ~ Geometric(q) tokens until the next use: the prior's value one token out.
        self._tail = (q / (1.0 - (1.0 - q) * r)).reshape(num_layers, num_experts)
        self.reset(())

    @classmethod
    def from_trace(cls, train: RoutingTrace, *, tau: float | None = None) -> ForecastPolicy:
        """The policy with use rates counted on the training split."""
        L, E = train.num_layers, train.num_experts
        counts = np.bincount(train.uids().reshape(-1), minlength=L * E)
        return cls(counts / train.num_tokens, num_layers=L, num_experts=E, tau=tau)

    # -- EvictionPolicy ---------------------------------------------------------------------------
    def reset(self, resident: Sequence[int]) -> None:
        n = self._L * self._E
        self._resident = np.zeros(n, dtype=bool)
        self._last = np.zeros(n, dtype=np.int64)  # recency tick of the last insert or use
        start = np.asarray(list(resident), dtype=np.int64)
        self._resident[start] = True
        self._last[start[::-1]] = np.arange(len(start))  # most valuable first = most recent
        self._tick = len(start)
        self._steps: np.ndarray | None = None
        self._probs: np.ndarray | None = None
        self._step = -1  # latest position known to be revealed
        self._version = 0  # bumped by every new forecast
        self._cache_key: tuple[int, int] | None = None
        self._values = np.zeros(n)

    def insert(self, uid: int, step: int) -> None:
        self._resident[uid] = True
        self._touch(uid, step)

    def access(self, uid: int, step: int) -> None:
        self._touch(uid, step)

    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        v = np.where(self._resident, self.values(), np.inf)
        v[_as_index(pinned, self._resident)] = np.inf
        i = int(np.argmin(v))
        if v[i] == np.inf:
            return None
        ties = np.flatnonzero(v == v[i])
        return i if len(ties) == 1 else int(ties[np.argmin(self._last[ties])])

    def remove(self, uid: int) -> None:
        self._resident[uid] = False

    # -- forecast side ----------------------------------------------------------------------------
    def update(self, forecast: Forecast | None, step: int) -> None:
        """A new forecast made at position `step` (its routing known); None keeps the last one."""
        if forecast is not None:
            self._steps = np.asarray(forecast.steps, dtype=np.int64)
            self._probs = np.clip(np.asarray(forecast.probs, dtype=np.float64), 0.0, 1.0)
            self._version += 1
        self._step = max(self._step, step)

    def keep_value(self, uids) -> np.ndarray:
        """[N] float64, the keep value of each uid (resident or not) at the current position."""
        return self.values()[uids]

    def values(self) -> np.ndarray:
        """[L * E] float64 keep values (a cached array: do not modify)."""
        key = (self._step, self._version)
        if key != self._cache_key:
            self._values = self._compute(self._step)
            self._cache_key = key
        return self._values

    def cheapest(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The `n` residents cheapest to evict, pinned or not: uids [n'] int64 and keep values [n']."""
        res = np.flatnonzero(self._resident)
        v = self.values()[res]
        if n < len(res):
            part = np.argpartition(v, n)[: n + 1]  # one extra so a tie at the cut sorts by recency
            res, v = res[part], v[part]
        order = np.lexsort((self._last[res], v))[:n]
        return res[order], v[order]

    def _touch(self, uid: int, step: int) -> None:
        self._tick += 1
        self._last[uid] = self._tick
        if step > self._step:
            self._step = step

    def _compute(self, cur: int) -> np.ndarray:
        """Keep values of all uids with positions <= `cur` revealed: [L * E] float64."""
        L, E, tau = self._L, self._E, self.tau
        value, survive, end = np.zeros((L, E)), np.ones((L, E)), cur
        if self._steps is not None:
            keep = self._steps > cur
            steps, probs = self._steps[keep], self._probs[keep]
            if len(steps):
                end = int(steps[-1])
                t0 = (cur + 1) // L * L  # first position of the grid's first token
                pos = steps - t0
                grid = np.zeros((int(pos[-1]) // L + 1, L, E))  # [tokens, L, E]; absent rows = 0
                grid[pos // L, pos % L] = probs
                dist = (t0 + np.arange(grid.shape[0] * L) - cur).reshape(-1, L)  # padding: p = 0
                stay = np.cumprod(1.0 - grid, axis=0)  # not used up to and including that token
                before = np.concatenate([np.ones((1, L, E)), stay[:-1]])
                value = (grid * before * np.exp(-dist / tau)[:, :, None]).sum(axis=0)
                survive = stay[-1]
        # Beyond the forecast: first position of each layer after `end`, then the geometric prior.
        nxt = end + 1 + (np.arange(L) - (end + 1)) % L
        tail = np.exp(-(nxt - cur) / tau)[:, None] * self._tail
        return (value + survive * tail).reshape(-1)


def _as_index(pinned: Container[int], resident: np.ndarray) -> np.ndarray:
    """Pinned uids as an index array (the simulator passes a set; other containers are scanned)."""
    try:
        return np.fromiter(pinned, dtype=np.int64)  # type: ignore[call-overload]
    except TypeError:
        res = np.flatnonzero(resident)
        return res[[int(u) in pinned for u in res.tolist()]]

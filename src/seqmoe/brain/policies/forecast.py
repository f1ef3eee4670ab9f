"""Probabilistic Belady: evict the expert whose forecast next use is furthest away or least likely.

Belady's rule evicts the expert used furthest in the future. With a forecast instead of the future,
each uid gets a *keep value*, the expected discount of its next use:

    keep(u) = E[exp(-(next_use(u) - now) / tau)]

Within the forecast, u's first use at its layer's h-th forecast row has probability
p_h * prod_{h' < h} (1 - p_h') (independence assumed). Past the last forecast position a learned
prior takes over: `ReuseTable`, fitted on the training split, gives E[discount of the wait] for
an expert unused for `a` tokens, by frequency class, by the gap between its last two uses and by
its recent use count (recency matters far more than frequency on real traces: a frequency-only
prior loses to LRU; the previous gap marks bursts; the recent count, the text's current topic).
A forecaster with a long-range head (`seqmoe.brain.predict.far_head`) multiplies that prior by its head's
value of the current token, for every uid (`set_far`).
With a certain forecast (one-hot rows) the keep value is exp(-distance / tau), so the policy
evicts exactly what Belady evicts whenever the victim's next use lies within the horizon; every
use beyond the horizon is worth less than any certain use within it.
Ties go to the least recently used.

    policy = ForecastPolicy.from_trace(train)
    policy.update(forecast, step)        # whenever a forecast arrives (the scheduler calls it)
    policy.keep_value(uids) -> [N]        # any uids, resident or not

Values are cached per (forecast, current position). Forecast entries are kept sparse (those of
at least `floor` probability), so long horizons stay cheap; `victim` is a few vectorised passes over
the L * E uids.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import numpy as np

from seqmoe.brain.policies.base import EvictionPolicy
from seqmoe.brain.policies.forecast_entries import EntriesAhead, first_use, no_entries, sparse_entries
from seqmoe.brain.policies.reuse import NUM_COUNT_CLASSES, ReuseTable, decayed_count, fitted_reuse_table, log2_bucket
from seqmoe.brain.predict.base import Forecast
from seqmoe.trace.schema import RoutingTrace


class ForecastPolicy(EvictionPolicy):
    """Evict the resident, unpinned uid with the lowest keep value (ties: least recently used).

    Args:
        use_rate: [L * E] float, probability that a token uses each uid (training counts / T); the
            prior beyond the horizon when `reuse` is None (a geometric wait at that rate).
        num_layers: L.
        num_experts: E.
        tau: discount scale in positions (a use `tau` positions later is worth 1/e of one now);
            defaults to two tokens (2 L).
        reuse: learned prior beyond the horizon (`fit_reuse_table` with the same tau).
        floor: forecast probabilities below this count as 0 (keeps the entries sparse).
    """

    compiled_as = "forecast"

    def __init__(self, use_rate: np.ndarray, *, num_layers: int, num_experts: int, tau: float | None = None,
                 reuse: ReuseTable | None = None, floor: float = 1e-4) -> None:
        self._L, self._E = num_layers, num_experts
        q = np.clip(np.asarray(use_rate, dtype=np.float64).reshape(-1), 1e-6, 1.0)
        if len(q) != num_layers * num_experts:
            raise ValueError(f"use_rate has {len(q)} entries, expected L * E = {num_layers * num_experts}")
        self.tau = float(tau) if tau is not None else 2.0 * num_layers
        self.reuse, self.floor = reuse, floor
        r = np.exp(-num_layers / self.tau)  # discount of one token
        self._geometric = q / (1.0 - (1.0 - q) * r)  # E[r^G], G ~ Geometric(q) tokens to the next use
        self._layer_of = np.repeat(np.arange(num_layers), num_experts)  # [L * E] layer of each uid
        self.reset(())

    @classmethod
    def from_trace(cls, train: RoutingTrace, *, tau: float | None = None, learned_reuse: bool = True,
                   num_gap_classes: int = 6, num_count_classes: int = NUM_COUNT_CLASSES) -> ForecastPolicy:
        """The policy with use rates (and, by default, a reuse table) learned on the training split."""
        L, E = train.num_layers, train.num_experts
        tau = float(tau) if tau is not None else 2.0 * L
        counts = np.bincount(train.uids().reshape(-1), minlength=L * E)
        reuse = fitted_reuse_table(train, tau, num_gap_classes, num_count_classes) if learned_reuse else None
        return cls(counts / train.num_tokens, num_layers=L, num_experts=E, tau=tau, reuse=reuse)

    @property
    def num_layers(self) -> int:
        """L, the layers its positions count."""
        return self._L

    def set_far(self, far: np.ndarray) -> None:
        """[L * E] the forecaster's long-range head values for this token (`seqmoe.brain.predict.far_head`):
        the prior beyond the forecast is multiplied by them until the next call."""
        self._far = np.asarray(far, dtype=np.float64)
        self._prior_key = None
        self._version += 1

    def set_prior(self, use_rate: np.ndarray, reuse: ReuseTable | None) -> None:
        """A new prior beyond the horizon (use rates, reuse table) from now on, the rest of the state
        kept: what an online learner refits (`seqmoe.brain.predict.online`); answers computed before are void."""
        q = np.clip(np.asarray(use_rate, dtype=np.float64).reshape(-1), 1e-6, 1.0)
        r = np.exp(-self._L / self.tau)
        self._geometric = q / (1.0 - (1.0 - q) * r)
        self.reuse = reuse
        self._classes, self._prior_key, self._prior_cache, self._cache_key = None, None, self._geometric, None
        self._version += 1

    # -- EvictionPolicy ---------------------------------------------------------------------------
    def reset(self, resident: Sequence[int]) -> None:
        n = self._L * self._E
        self._resident = np.zeros(n, dtype=bool)
        self._last = np.zeros(n, dtype=np.int64)  # recency tick of the last insert or use
        self._last_step = np.full(n, -1, dtype=np.int64)  # position of the last use (or insert)
        self._last_use = np.full(n, -1, dtype=np.int64)  # position of the last use
        self._prev_gap = np.zeros(n, dtype=np.int64)  # tokens between the last two uses (0: one use or none)
        self._recent = np.zeros(n)  # recent use count at the last use (`reuse.decayed_count`)
        start = np.asarray(list(resident), dtype=np.int64)
        self._resident[start] = True
        self._last[start[::-1]] = np.arange(len(start))  # most valuable first = most recent
        self._tick = len(start)
        self._steps: np.ndarray | None = None  # [H] rows of the latest forecast
        self._entries = no_entries()  # its sparse entries (uid, step, p), by uid then step
        self._step = -1  # latest position known to be revealed
        self._version = 0  # bumped by every new forecast
        self._mut = 0  # bumped by every change of the resident set or of the recency state
        self._cache_key: tuple[int, int] | None = None
        self._values, self._unused = np.zeros(n), np.ones(n)
        self._ahead_cache: EntriesAhead | None = None  # entries after the current position, per (position, forecast)
        self._classes: np.ndarray | None = None  # the reuse prior's class of each uid (None: recompute)
        self._memo_key: tuple[int, int, int] | None = None
        self._memo: dict = {}  # victim_at answers for one (position, forecast, state)
        self._touches = 0  # bumped by every insert or use (the prior beyond the horizon changes)
        self._prior_key: tuple[int, int] | None = None
        self._prior_cache = self._geometric
        self._far: np.ndarray | None = None  # the long-range head's values (`set_far`)
        self._disc = np.zeros(0)  # exp(-d / tau) for d = 0, 1, ... (the discount of d positions)
        self._grow = np.zeros(0)  # exp(d / tau)
        self._layer_disc: dict = {}  # (end, cur) -> first position of each layer after end, its discount

    def insert(self, uid: int, step: int) -> None:
        self._resident[uid] = True
        self._touch(uid, step)

    def access(self, uid: int, step: int) -> None:
        last = self._last_use[uid]
        gap = (step - last) // self._L if last >= 0 else 0
        self._prev_gap[uid] = gap
        self._recent[uid] = decayed_count(self._recent[uid], gap) if last >= 0 else 0.0
        self._last_use[uid] = step
        self._classes = None
        self._touch(uid, step)

    note_use = access
    """A use served off the pool (read in place, computed on the host): the recency and reuse
    history count it; the resident set does not change."""

    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        v = self.values().copy()
        v[_as_index(pinned, self._resident)] = np.inf
        return self.cheapest_resident(v)

    def remove(self, uid: int) -> None:
        self._resident[uid] = False
        self._mut += 1

    # -- forecast side ----------------------------------------------------------------------------
    def update(self, forecast: Forecast | None, step: int) -> None:
        """A new forecast made at position `step` (its routing known); None keeps the last one."""
        if forecast is not None:
            self._steps = np.asarray(forecast.steps, dtype=np.int64)
            self._entries = sparse_entries(self._steps, forecast.probs, self._L, self._E, self.floor)
            self._version += 1
        self._step = max(self._step, step)

    def state_key(self) -> tuple[int, int, int]:
        """Changes whenever an answer of this policy may change (position, forecast, resident set, recency).

        Two calls that return equal keys bracket no `update`, `reset`, `insert`, `access` or `remove`
        that matters: results computed under one key (`first_uses`, `keep_value`, `cheapest`,
        `victim_at`, ...) hold for the other.
        """
        return self._step, self._version, self._mut

    def keep_value(self, uids) -> np.ndarray:
        """[N] float64, the keep value of each uid (resident or not) at the current position."""
        return self.values()[uids]

    def values(self) -> np.ndarray:
        """[L * E] float64 keep values (a cached array: do not modify).

        Computed on the first call after the position or the forecast changes, and kept until the
        next such change (recency updates in between do not recompute it).
        """
        key = (self._step, self._version)
        if key != self._cache_key:
            self._values, self._unused = self._compute(self._step)
            self._cache_key = key
        return self._values

    def use_prob(self, uids) -> np.ndarray:
        """[N] float64, probability that each uid is used within the forecast (0 without one)."""
        self.values()
        return 1.0 - self._unused[uids]

    def victim_at(self, step: int, max_harm: float) -> tuple[int | None, bool]:
        """Whom a copy needed at `step` should displace, decided now (conservative prefetching).

        The right victim is the resident this policy will rank cheapest when `step` routes
        (Belady's victim then, with a certain forecast). If that resident may still be used
        before `step` (probability > `max_harm`), evicting anyone now could cost an extra copy:
        the caller should wait. Residents unlikely to be used before `step` keep their order (their
        values all scale by the same discount), so only the likely ones are re-valued.

        Answers are memoised until the position, the forecast, the resident set or the recency state
        changes (`state_key`).

        Args:
            step: a position after the current one.
            max_harm: largest acceptable probability that the victim is used before `step`.

        Returns:
            (victim, wait): the resident to evict (None when nothing is resident) and whether the
            copy should wait for a later decision instead. The victim may be pinned right now.
        """
        key = self.state_key()
        if key != self._memo_key:
            self._memo_key, self._memo = key, {}
        hit = self._memo.get((step, max_harm))
        if hit is None:
            hit = self._memo[(step, max_harm)] = self._victim_at(step, max_harm)
        return hit

    def _victim_at(self, step: int, max_harm: float) -> tuple[int | None, bool]:
        n = self._L * self._E
        values = self.values()
        ahead = self._ahead()
        likely = ahead.likely_before(step, max_harm)
        busy = self._resident & likely  # likely used before `step`
        free = np.where(busy, np.inf, values)
        victim = self.cheapest_resident(free)
        if victim is None:  # nothing resident, or every resident is likely needed before `step`
            return None, bool(busy.any())
        idx = np.flatnonzero(busy)
        if not len(idx):
            return victim, False
        # Values at `step` (uses at `step` count: those experts are pinned then) of the busy ones.
        sel = np.flatnonzero(busy[ahead.uid] & (ahead.s >= step))
        used = ahead.uid[sel]
        later = self._tail(step - 1, idx)  # a busy uid without entries from `step` on: value 0, stay 1
        if len(used) and not np.any(used[1:] == used[:-1]):
            # At most one entry per uid: its first-use probability is p itself and its no-use
            # probability 1 - p, the very numbers `first_use` computes for a group of one entry.
            at = np.searchsorted(idx, used)
            later[at] = ahead.p[sel] * self._discount(ahead.s[sel] - (step - 1)) + (1.0 - ahead.p[sel]) * later[at]
        elif len(used):
            value, stay = first_use(used, ahead.s[sel], ahead.p[sel], step - 1, self.tau, n, only=idx)
            later = value + stay * later
        shift = self._growth(step - 1 - self._step)  # the free ones' values, seen from step - 1
        return victim, bool(later.min() < free[victim] * shift)

    def first_uses(self, min_prob: float) -> tuple[np.ndarray, np.ndarray]:
        """Each uid's first coming position forecast with probability >= `min_prob`.

        Returns:
            uids [N] int64 (increasing) and steps [N] int64.
        """
        uid, s = self._ahead().first_uses(min_prob)
        return uid.copy(), s.copy()

    def cheapest_resident(self, values: np.ndarray) -> int | None:
        """The resident uid (pinned or not) with the lowest `values` [L * E], ties by least recent use."""
        v = np.where(self._resident, values, np.inf)
        i = int(np.argmin(v))
        if v[i] == np.inf:
            return None
        ties = np.flatnonzero(v == v[i])
        return i if len(ties) == 1 else int(ties[np.argmin(self._last[ties])])

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
        self._mut += 1
        self._touches += 1
        self._last[uid] = self._tick
        self._last_step[uid] = step
        if step > self._step:
            self._step = step

    def _ahead(self) -> EntriesAhead:
        """The forecast entries after the current position, with what is derived from them."""
        a = self._ahead_cache
        if a is None or a.key != (self._step, self._version):
            uid, s, p = self._entries
            m = s > self._step
            a = self._ahead_cache = EntriesAhead((self._step, self._version), uid[m], s[m], p[m], self._L * self._E)
        return a

    def _compute(self, cur: int) -> tuple[np.ndarray, np.ndarray]:
        """With positions <= `cur` (the current one) revealed: keep values [L * E] and P(no forecast use) [L * E]."""
        a = self._ahead()
        value, survive = first_use(a.uid, a.s, a.p, cur, self.tau, self._L * self._E, before=a.before, after=a.after)
        return value + survive * self._tail(cur), survive

    def _tail(self, cur: int, idx: np.ndarray | None = None) -> np.ndarray:
        """Value of a use beyond the forecast, seen from `cur`: discount times the prior.

        [L * E], or [N] for the uids `idx` only (the same numbers, elementwise).
        """
        L = self._L
        end = cur
        if self._steps is not None and len(self._steps) and self._steps[-1] > cur:
            end = int(self._steps[-1])
        # The first position of each layer after `end`, then the prior's expected wait.
        hit = self._layer_disc.get((end, cur))
        if hit is None:
            if len(self._layer_disc) >= 256:
                self._layer_disc.clear()
            nxt = end + 1 + (np.arange(L) - (end + 1)) % L  # [L]
            hit = self._layer_disc[(end, cur)] = (nxt, self._discount(nxt - cur))  # [L], [L]
        nxt, disc = hit
        prior = self._prior(end, nxt)
        if idx is None:
            return disc[self._layer_of] * prior
        return disc[self._layer_of[idx]] * prior[idx]

    def _prior(self, end: int, nxt: np.ndarray) -> np.ndarray:
        """[L * E] prior of the next use after `end` (`nxt`: [L] first position of each layer after it).

        Kept until `end` moves or a uid is inserted or used.
        """
        key = (end, self._touches)
        if key != self._prior_key:
            if self.reuse is None:
                prior = self._geometric
            else:
                age = (nxt[self._layer_of] - self._last_step) // self._L
                if self._classes is None:  # each uid's row of the table, kept until a use
                    self._classes = self.reuse.rows(self._prev_gap, self._recent)
                prior = self.reuse.values[self._classes, log2_bucket(age, self.reuse.values.shape[1])]
            self._prior_key, self._prior_cache = key, prior if self._far is None else prior * self._far
        return self._prior_cache

    def _discount(self, d: np.ndarray) -> np.ndarray:
        """exp(-d / tau) for integer distances d >= 0 (looked up: the numbers np.exp gives for them)."""
        top = int(d.max()) if len(d) else 0
        if top >= len(self._disc):
            self._disc = discount_table(self.tau, max(2 * top + 1, 64))[0]
        return self._disc[d]

    def _growth(self, d: int) -> float:
        """exp(d / tau) for an integer d >= 0, from the same table as the compiled manager's."""
        if d >= len(self._grow):
            self._grow = discount_table(self.tau, max(2 * d + 1, 64))[1]
        return float(self._grow[d])


def discount_table(tau: float, size: int) -> np.ndarray:
    """[2, size]: exp(-d / tau) and exp(d / tau) for d = 0 .. size - 1."""
    d = np.arange(size)
    return np.stack([np.exp(-d / tau), np.exp(d / tau)])


def _as_index(pinned: Container[int], resident: np.ndarray) -> np.ndarray:
    """Pinned uids as an index array (the simulator passes a set; other containers are scanned)."""
    try:
        return np.fromiter(pinned, dtype=np.int64)  # type: ignore[call-overload]
    except TypeError:
        res = np.flatnonzero(resident)
        return res[[int(u) in pinned for u in res.tolist()]]

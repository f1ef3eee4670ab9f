"""Probabilistic Belady: evict the expert whose forecast next use is furthest away or least likely.

Belady's rule evicts the expert used furthest in the future. With a forecast instead of the future,
each uid gets a *keep value*, the expected discount of its next use:

    keep(u) = E[exp(-(next_use(u) - now) / tau)]

Within the forecast, u's first use at its layer's h-th forecast row has probability
p_h * prod_{h' < h} (1 - p_h') (independence assumed). Past the last forecast position a learned
prior takes over: `ReuseTable`, fitted on the training split, gives E[discount of the wait] for
an expert unused for `a` tokens, by frequency class and by the gap between its last two uses
(recency matters far more than frequency on real traces: a frequency-only prior loses to LRU;
the previous gap marks bursts: prior-only eviction at r=0.45 reaches bound fraction 0.409 with it,
0.398 without, LRU 0.366). With a certain forecast (one-hot rows) the keep value is
exp(-distance / tau), so the policy evicts exactly what Belady evicts whenever the victim's next use
lies within the horizon; every use beyond the horizon is worth less than any certain use within it.
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
from dataclasses import dataclass

import numpy as np

from seqmoe.predict.base import Forecast
from seqmoe.trace.schema import RoutingTrace


@dataclass(frozen=True)
class ReuseTable:
    """Learned prior beyond the horizon: E[rho^wait | unused for `age` tokens] per frequency class.

    Attributes:
        values: [Q, B] float64; entry (c, b) averages rho^(G - a) over reuse gaps G >= a of the
            uids of class c, for ages a (tokens since the last use) in [2^b, 2^(b+1)); rho =
            exp(-L / tau) is one token's discount. Gaps still open at the end of the trace count 0.
        uid_class: [L * E] int64, the frequency class (quantile of training use rate) of each uid.
    """

    values: np.ndarray
    uid_class: np.ndarray
    num_gap_classes: int = 1

    def lookup(self, age_tokens: np.ndarray, prev_gap_tokens: np.ndarray | None = None) -> np.ndarray:
        """[L * E] prior values for [L * E] ages (>= 1 token) and gaps before the last use (0: none)."""
        b = _log2_bucket(age_tokens, self.values.shape[1])
        cls = self.uid_class * self.num_gap_classes
        if prev_gap_tokens is not None and self.num_gap_classes > 1:
            cls = cls + _gap_class(prev_gap_tokens, self.num_gap_classes)
        return self.values[cls, b]


def _log2_bucket(x: np.ndarray, n: int) -> np.ndarray:
    return np.minimum(np.log2(np.maximum(x, 1)).astype(np.int64), n - 1)


def _gap_class(prev_gap: np.ndarray, n: int) -> np.ndarray:
    """0 for no earlier use, else 1 + log2 bucket of the gap (capped at n - 1)."""
    return np.where(prev_gap > 0, np.minimum(1 + _log2_bucket(prev_gap, n), n - 1), 0)


def fit_reuse_table(train: RoutingTrace, tau: float, *, num_buckets: int = 16, num_classes: int = 4,
                    num_gap_classes: int = 1, max_tokens: int = 60_000) -> ReuseTable:
    """Fit a `ReuseTable` on (the first `max_tokens` tokens of) the training split."""
    train = train.head(max_tokens)
    T, L, _ = train.expert_ids.shape
    E = train.num_experts
    rho = np.exp(-L / tau)
    rate = np.bincount(train.uids().reshape(-1), minlength=L * E) / T
    uid_class = np.searchsorted(np.quantile(rate, np.linspace(0, 1, num_classes + 1)[1:-1]), rate, side="right")
    lo = 2 ** np.arange(num_buckets)
    hi = np.r_[lo[1:] - 1, np.iinfo(np.int64).max // 4]
    Q = num_classes * num_gap_classes
    sums, counts = np.zeros((Q, num_buckets)), np.zeros((Q, num_buckets))
    keys = np.sort((train.uids().astype(np.int64) * (T + 1) + np.arange(T)[:, None, None]).reshape(-1))
    uid, tok = keys // (T + 1), keys % (T + 1)
    open_end = np.r_[uid[1:] != uid[:-1], True]  # a uid's last use: its gap runs to the end unseen
    gap = np.where(open_end, T - tok, np.r_[np.diff(tok), 0])
    first = np.r_[True, open_end[:-1]]
    prev_gap = np.where(first, 0, np.r_[0, np.diff(tok)])
    cls = uid_class[uid] * num_gap_classes + _gap_class(prev_gap, num_gap_classes)
    for b in range(num_buckets):
        top = np.minimum(hi[b], gap)  # ages lo[b]..top of this gap fall in bucket b
        n = np.maximum(0, top - lo[b] + 1)
        # sum_{a = lo}^{top} rho^(gap - a), a geometric series; open gaps are worth 0.
        s = np.where(open_end | (n == 0), 0.0, rho ** (gap - top) * (1 - rho ** n) / (1 - rho))
        sums[:, b] = np.bincount(cls, weights=s, minlength=Q)
        counts[:, b] = np.bincount(cls, weights=n, minlength=Q)
    return ReuseTable(sums / np.maximum(counts, 1), uid_class.astype(np.int64), num_gap_classes)


_FITTED: dict[tuple[int, float, int], tuple[RoutingTrace, ReuseTable]] = {}


def _fitted_reuse_table(train: RoutingTrace, tau: float, num_gap_classes: int) -> ReuseTable:
    """`fit_reuse_table`, fitted once per training trace object (sweeps build many policies)."""
    key = (id(train), tau, num_gap_classes)
    hit = _FITTED.get(key)
    if hit is None or hit[0] is not train:  # the trace is kept alive with its table: ids stay unique
        if len(_FITTED) >= 4:
            _FITTED.clear()
        hit = _FITTED[key] = (train, fit_reuse_table(train, tau, num_gap_classes=num_gap_classes))
    return hit[1]


class ForecastPolicy:
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
                   num_gap_classes: int = 6) -> ForecastPolicy:
        """The policy with use rates (and, by default, a reuse table) learned on the training split."""
        L, E = train.num_layers, train.num_experts
        tau = float(tau) if tau is not None else 2.0 * L
        counts = np.bincount(train.uids().reshape(-1), minlength=L * E)
        reuse = _fitted_reuse_table(train, tau, num_gap_classes) if learned_reuse else None
        return cls(counts / train.num_tokens, num_layers=L, num_experts=E, tau=tau, reuse=reuse)

    # -- EvictionPolicy ---------------------------------------------------------------------------
    def reset(self, resident: Sequence[int]) -> None:
        n = self._L * self._E
        self._resident = np.zeros(n, dtype=bool)
        self._last = np.zeros(n, dtype=np.int64)  # recency tick of the last insert or use
        self._last_step = np.full(n, -1, dtype=np.int64)  # position of the last use (or insert)
        self._last_use = np.full(n, -1, dtype=np.int64)  # position of the last use
        self._prev_gap = np.zeros(n, dtype=np.int64)  # tokens between the last two uses (0: one use or none)
        start = np.asarray(list(resident), dtype=np.int64)
        self._resident[start] = True
        self._last[start[::-1]] = np.arange(len(start))  # most valuable first = most recent
        self._tick = len(start)
        self._steps: np.ndarray | None = None  # [H] rows of the latest forecast
        self._entries = _no_entries()  # its sparse entries (uid, step, p), by uid then step
        self._entry_terms = _entry_terms(self._entries[2])  # their (certain, log(1 - p)), elementwise
        self._step = -1  # latest position known to be revealed
        self._version = 0  # bumped by every new forecast
        self._mut = 0  # bumped by every change of the resident set or of the recency state
        self._cache_key: tuple[int, int] | None = None
        self._values, self._unused = np.zeros(n), np.ones(n)
        self._ahead_cache: _Ahead | None = None  # entries after the current position, per (position, forecast)
        self._classes: np.ndarray | None = None  # the reuse prior's class of each uid (None: recompute)
        self._memo_key: tuple[int, int, int] | None = None
        self._memo: dict = {}  # victim_at answers for one (position, forecast, state)
        self._touches = 0  # bumped by every insert or use (the prior beyond the horizon changes)
        self._prior_key: tuple[int, int] | None = None
        self._prior_cache = self._geometric
        self._disc = np.zeros(0)  # exp(-d / tau) for d = 0, 1, ... (the discount of d positions)
        self._layer_disc: dict = {}  # (end, cur) -> first position of each layer after end, its discount

    def insert(self, uid: int, step: int) -> None:
        self._resident[uid] = True
        self._touch(uid, step)

    def access(self, uid: int, step: int) -> None:
        last = self._last_use[uid]
        self._prev_gap[uid] = (step - last) // self._L if last >= 0 else 0
        self._last_use[uid] = step
        self._classes = None
        self._touch(uid, step)

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
            self._entries = _sparse_entries(self._steps, forecast.probs, self._L, self._E, self.floor)
            self._entry_terms = _entry_terms(self._entries[2])
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
        if likely is None:  # the threshold shortcut does not apply: sum the survival directly
            uid, s, p = self._entries
            m = (s > self._step) & (s < step)
            likely = _survival(uid[m], p[m], n) < 1.0 - max_harm
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
            # probability exp(log(1 - p)) (0 if certain), the very numbers `_first_use` computes
            # for a group of one entry, so no running sum over the other uids is needed.
            at = np.searchsorted(idx, used)
            stay = np.where(ahead.certain[sel], 0.0, np.exp(ahead.log_stay[sel]))
            later[at] = ahead.p[sel] * self._discount(ahead.s[sel] - (step - 1)) + stay * later[at]
        elif len(used):
            certain, log_stay = ahead.certain[sel], ahead.log_stay[sel]
            value, stay = _first_use(used, ahead.s[sel], ahead.p[sel], step - 1, self.tau, n,
                                     certain=certain, log_stay=log_stay, only=idx)
            later = value + stay * later
        shift = np.exp((step - 1 - self._step) / self.tau)  # the free ones' values, seen from step - 1
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

    def _ahead(self) -> _Ahead:
        """The forecast entries after the current position, with what is derived from them."""
        a = self._ahead_cache
        if a is None or a.key != (self._step, self._version):
            uid, s, p = self._entries
            certain, log_stay = self._entry_terms
            m = s > self._step
            a = self._ahead_cache = _Ahead((self._step, self._version), uid[m], s[m], p[m], certain[m],
                                           log_stay[m], self._L * self._E)
        return a

    def _compute(self, cur: int) -> tuple[np.ndarray, np.ndarray]:
        """With positions <= `cur` revealed: keep values [L * E] and P(no forecast use) [L * E]."""
        if cur == self._step:
            a = self._ahead()
            uid, s, p, certain, log_stay = a.uid, a.s, a.p, a.certain, a.log_stay
        else:
            uid, s, p = self._entries
            m = s > cur
            uid, s, p = uid[m], s[m], p[m]
            certain, log_stay = self._entry_terms[0][m], self._entry_terms[1][m]
        value, survive = _first_use(uid, s, p, cur, self.tau, self._L * self._E, certain=certain, log_stay=log_stay)
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
        if self.reuse is None:
            return self._geometric
        key = (end, self._touches)
        if key != self._prior_key:
            L = self._L
            if type(self.reuse) is ReuseTable:
                age = (nxt[self._layer_of] - self._last_step) // L
                prior = self.reuse.values[self._reuse_classes(), _log2_bucket(age, self.reuse.values.shape[1])]
            else:  # another prior: ask it
                prior = self.reuse.lookup((np.repeat(nxt, self._E) - self._last_step) // L, self._prev_gap)
            self._prior_key, self._prior_cache = key, prior
        return self._prior_cache

    def _discount(self, d: np.ndarray) -> np.ndarray:
        """exp(-d / tau) for integer distances d >= 0 (looked up: the numbers np.exp gives for them)."""
        top = int(d.max()) if len(d) else 0
        if top >= len(self._disc):
            self._disc = np.exp(-np.arange(max(2 * top + 1, 64)) / self.tau)
        return self._disc[d]

    def _reuse_classes(self) -> np.ndarray:
        """[L * E] row of `reuse.values` for each uid (`ReuseTable.lookup`'s), kept until a use."""
        if self._classes is None:
            reuse = self.reuse
            cls = reuse.uid_class * reuse.num_gap_classes
            if reuse.num_gap_classes > 1:
                cls = cls + _gap_class(self._prev_gap, reuse.num_gap_classes)
            self._classes = cls
        return self._classes


class _Ahead:
    """Forecast entries after one position (by uid then step) and answers derived from them alone."""

    def __init__(self, key, uid, s, p, certain, log_stay, n: int) -> None:
        self.key, self.uid, self.s, self.p, self.certain, self.log_stay, self.n = key, uid, s, p, certain, log_stay, n
        m = len(uid)
        head = np.empty(m, dtype=bool)
        if m:
            head[0] = True
            np.not_equal(uid[1:], uid[:-1], out=head[1:])
        self.head = head  # first entry of each uid
        self.start = np.maximum.accumulate(np.where(head, np.arange(m), 0))  # group start per entry
        self.pairs = m < 2 or not np.any(~head[1:] & ~head[:-1])  # at most two entries per uid
        self._likely: dict = {}
        self._first: dict = {}

    def first_uses(self, min_prob: float) -> tuple[np.ndarray, np.ndarray]:
        hit = self._first.get(min_prob)
        if hit is None:
            m = self.p >= min_prob
            uid, s = self.uid[m], self.s[m]
            head = np.empty(len(uid), dtype=bool)
            if len(uid):
                head[0] = True
                np.not_equal(uid[1:], uid[:-1], out=head[1:])
            hit = self._first[min_prob] = (uid[head], s[head])
        return hit

    def likely_before(self, step: int, max_harm: float) -> np.ndarray | None:
        """[n] bool: P(some entry before `step` is a use) > max_harm, exactly as `_survival` of those
        entries compares with 1 - max_harm; None where the shortcut does not hold (then sum directly).

        Per uid, the survival of its first k entries is the running sum of their log(1 - p) in entry
        order (what bincount adds up), so it is computed once per entry; a uid is likely before `step`
        once some entry before `step` makes it so (checked to be monotone).
        """
        first = self._likely.get(max_harm, False)
        if first is False:
            first = self._likely[max_harm] = self._first_likely(max_harm)
        if first is None:
            return None
        return first < step

    def _first_likely(self, max_harm: float) -> np.ndarray | None:
        """[n] int64, per uid the first entry step at which it is likely (a huge number if never)."""
        bound = 1.0 - max_harm
        if 1.0 < bound:  # likely with no entry at all: no threshold to find
            return None
        uid, log_stay, certain, head, start = self.uid, self.log_stay, self.certain, self.head, self.start
        m = len(uid)
        total = log_stay.copy()  # running sum per uid, added in entry order from 0.0
        if self.pairs:  # the second entry of a uid adds to the first
            at = np.flatnonzero(~head)
            total[at] = total[at - 1] + log_stay[at]
        else:
            rank = np.arange(m) - start
            for r in range(1, int(rank.max()) + 1 if m else 0):
                at = np.flatnonzero(rank == r)
                total[at] = total[at - 1] + log_stay[at]
        unused = np.exp(total)
        if certain.any():
            cc = np.cumsum(certain)
            used = cc - (cc[start] - certain[start]) > 0  # a certain use at or before this entry
            unused[used] = 0.0
        like = unused < bound
        if m < 2:
            at = like
        else:
            if np.any(like[:-1] & ~like[1:] & ~head[1:]):  # not monotone within a uid
                return None
            at = like.copy()  # the first likely entry of each uid
            at[1:] &= head[1:] | ~like[:-1]
        first = np.full(self.n, np.iinfo(np.int64).max, dtype=np.int64)
        first[uid[at]] = self.s[at]
        return first


def _entry_terms(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per forecast entry: whether it is certain (p >= 1) and log(1 - p) (0 where certain)."""
    certain = p >= 1.0  # log(1 - p) would be -inf: counted apart, exactly
    return certain, np.log1p(-np.where(certain, 0.0, p))


def _no_entries() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)


def _sparse_entries(steps: np.ndarray, probs: np.ndarray, L: int, E: int, floor: float):
    """Forecast entries of probability >= floor as (uid [n], step [n], p [n]), by uid then step."""
    probs = np.asarray(probs)
    r, e = np.nonzero(probs >= floor)
    uid = (steps[r] % L) * E + e
    order = np.argsort(uid, kind="stable")  # rows ascend, so steps ascend within a uid
    return uid[order], steps[r][order], np.minimum(probs[r, e][order].astype(np.float64), 1.0)


def _survival(uid, p, n):
    """[n] probability that no entry (uid [m], p [m]) is a use, per uid (independence assumed)."""
    certain, log_stay = _entry_terms(p)
    used = np.bincount(uid, weights=certain, minlength=n) > 0
    return np.where(used, 0.0, np.exp(np.bincount(uid, weights=log_stay, minlength=n)))


def _first_use(uid, step, p, cur, tau, n, *, certain=None, log_stay=None, only=None):
    """Discounted first-use value and no-use probability per uid from sparse entries.

    Args:
        uid, step, p: [m] entries sorted by uid then step.
        cur: the position distances count from.
        tau: discount scale in positions.
        n: L * E.
        certain, log_stay: [m] `_entry_terms(p)` when already at hand (the same numbers).
        only: [N] uids to return (default: all n); their numbers do not depend on it.

    Returns:
        value [n]: sum over entries of P(first use there) * exp(-(step - cur) / tau);
        survive [n]: P(no use at any entry).
    """
    if certain is None:
        certain, log_stay = _entry_terms(p)
    m = len(uid)
    any_certain = bool(certain.any())
    if m:
        head = np.empty(m, dtype=bool)
        head[0] = True
        np.not_equal(uid[1:], uid[:-1], out=head[1:])
        first = np.maximum.accumulate(np.where(head, np.arange(m), 0))  # group start per entry
        cs = np.cumsum(log_stay)
        before = cs - log_stay - (cs[first] - log_stay[first])  # log P(unused at earlier entries)
        f = p * np.exp(before)
        if any_certain:
            cc = np.cumsum(certain)
            dead = (cc - certain) - (cc[first] - certain[first]) > 0  # a certain use came earlier
            f = np.where(dead, 0.0, f)
    else:
        f = p
    value = np.bincount(uid, weights=f * np.exp(-(step - cur) / tau), minlength=n)
    log_survive = np.bincount(uid, weights=log_stay, minlength=n)
    if only is not None:
        value, log_survive = value[only], log_survive[only]
    survive = np.exp(log_survive)
    if any_certain:
        used = np.zeros(n, dtype=bool)
        used[uid[certain]] = True
        survive = np.where(used if only is None else used[only], 0.0, survive)
    return value, survive


def _as_index(pinned: Container[int], resident: np.ndarray) -> np.ndarray:
    """Pinned uids as an index array (the simulator passes a set; other containers are scanned)."""
    try:
        return np.fromiter(pinned, dtype=np.int64)  # type: ignore[call-overload]
    except TypeError:
        res = np.flatnonzero(resident)
        return res[[int(u) in pinned for u in res.tolist()]]

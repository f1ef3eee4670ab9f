"""The learned prior of `ForecastPolicy` beyond its forecast: how soon an expert is used again.

`ReuseTable`, fitted on a training trace, gives E[discount of the wait until the next use] for an
expert unused for `a` tokens, by the expert's frequency class, by the gap between its last two
uses (bursts: an expert used twice in a row is likely used again soon) and by its recent use
count, a count of its earlier uses decayed by 1/e every `COUNT_DECAY_TOKENS` tokens (an expert
the current text keeps using is used again sooner than its age alone says).

    table = fit_reuse_table(train, tau)
    table.lookup(age_tokens, prev_gap_tokens, recent_counts) -> [L * E]

The recent count of a uid is updated at each of its uses by `decayed_count` (the compiled
manager does the same arithmetic with the same `DECAY` table).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from seqmoe.trace.schema import RoutingTrace

COUNT_DECAY_TOKENS = 16.0
"""Tokens over which a use's weight in the recent count falls to 1/e."""
COUNT_EDGES = np.array([0.02, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0])
"""Recent-count classes: class c holds counts in (COUNT_EDGES[c - 1], COUNT_EDGES[c]]."""
NUM_COUNT_CLASSES = len(COUNT_EDGES) + 1
DECAY = np.exp(-np.arange(1024) / COUNT_DECAY_TOKENS)
"""DECAY[g]: the recent count's decay over a gap of g tokens (looked up, so that every implementation
computes the same numbers; gaps past the table use its last entry, ~1e-28)."""
MIN_SAMPLES = 50
"""Entries of the fine table seen fewer times in training fall back to the table without recent counts."""


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
    num_count_classes: int = 1

    def rows(self, prev_gap_tokens: np.ndarray | None = None, recent: np.ndarray | None = None) -> np.ndarray:
        """[L * E] row of `values` for each uid, given the gaps before their last uses (0: none) and
        their recent counts (`decayed_count`, 0 for none)."""
        cls = self.uid_class * self.num_gap_classes
        if prev_gap_tokens is not None and self.num_gap_classes > 1:
            cls = cls + gap_class(prev_gap_tokens, self.num_gap_classes)
        cls = cls * self.num_count_classes
        if recent is not None and self.num_count_classes > 1:
            cls = cls + count_class(recent)
        return cls

    def lookup(self, age_tokens: np.ndarray, prev_gap_tokens: np.ndarray | None = None,
               recent: np.ndarray | None = None) -> np.ndarray:
        """[L * E] prior values for [L * E] ages (>= 1 token), gaps and recent counts (see `rows`)."""
        return self.values[self.rows(prev_gap_tokens, recent), log2_bucket(age_tokens, self.values.shape[1])]


def log2_bucket(x: np.ndarray, n: int) -> np.ndarray:
    return np.minimum(np.log2(np.maximum(x, 1)).astype(np.int64), n - 1)


def gap_class(prev_gap: np.ndarray, n: int) -> np.ndarray:
    """0 for no earlier use, else 1 + log2 bucket of the gap (capped at n - 1)."""
    return np.where(prev_gap > 0, np.minimum(1 + log2_bucket(prev_gap, n), n - 1), 0)


def count_class(recent: np.ndarray) -> np.ndarray:
    """The recent-count class of each count (see `COUNT_EDGES`)."""
    return np.searchsorted(COUNT_EDGES, recent)


def decayed_count(prev: np.ndarray | float, gap_tokens: np.ndarray | int) -> np.ndarray | float:
    """The recent count after a use `gap_tokens` after the previous one, whose count was `prev`."""
    return (prev + 1.0) * DECAY[np.minimum(gap_tokens, len(DECAY) - 1)]


def _recent_counts(uid, tok, decay):
    """The recent count at each use (uses sorted by uid, then token): `decayed_count` along each uid's uses."""
    return _compiled(_recent_counts_loop)(uid, tok, decay)


@functools.cache
def _compiled(fn):
    import numba  # numba: only when a table is fitted (config reads the systems without it)

    return numba.njit(cache=True)(fn)


def _recent_counts_loop(uid, tok, decay):
    out = np.zeros(len(uid))
    for i in range(1, len(uid)):
        if uid[i] == uid[i - 1]:
            out[i] = (out[i - 1] + 1.0) * decay[min(tok[i] - tok[i - 1], len(decay) - 1)]
    return out


def fit_reuse_table(train: RoutingTrace, tau: float, *, num_buckets: int = 16, num_classes: int = 4,
                    num_gap_classes: int = 1, num_count_classes: int = 1, max_tokens: int = 60_000) -> ReuseTable:
    """Fit a `ReuseTable` on (the first `max_tokens` tokens of) the training split.

    `num_count_classes`: 1 (recent counts ignored) or `NUM_COUNT_CLASSES`."""
    if num_count_classes not in (1, NUM_COUNT_CLASSES):
        raise ValueError(f"num_count_classes must be 1 or {NUM_COUNT_CLASSES}, got {num_count_classes}")
    train = train.head(max_tokens)
    T, L, _ = train.expert_ids.shape
    E = train.num_experts
    rho = np.exp(-L / tau)
    rate = np.bincount(train.uids().reshape(-1), minlength=L * E) / T
    uid_class = np.searchsorted(np.quantile(rate, np.linspace(0, 1, num_classes + 1)[1:-1]), rate, side="right")
    lo = 2 ** np.arange(num_buckets)
    hi = np.r_[lo[1:] - 1, np.iinfo(np.int64).max // 4]
    keys = np.sort((train.uids().astype(np.int64) * (T + 1) + np.arange(T)[:, None, None]).reshape(-1))
    uid, tok = keys // (T + 1), keys % (T + 1)
    open_end = np.r_[uid[1:] != uid[:-1], True]  # a uid's last use: its gap runs to the end unseen
    gap = np.where(open_end, T - tok, np.r_[np.diff(tok), 0])
    first = np.r_[True, open_end[:-1]]
    prev_gap = np.where(first, 0, np.r_[0, np.diff(tok)])
    coarse = uid_class[uid] * num_gap_classes + gap_class(prev_gap, num_gap_classes)
    Q = num_classes * num_gap_classes
    values, _ = _fit_values(coarse, gap, open_end, Q, lo, hi, rho)
    if num_count_classes > 1:
        fine = coarse * num_count_classes + count_class(_recent_counts(uid, tok, DECAY))
        fine_values, fine_seen = _fit_values(fine, gap, open_end, Q * num_count_classes, lo, hi, rho)
        values = np.where(fine_seen >= MIN_SAMPLES, fine_values, np.repeat(values, num_count_classes, axis=0))
    return ReuseTable(values, uid_class.astype(np.int64), num_gap_classes, num_count_classes)


def _fit_values(cls, gap, open_end, Q, lo, hi, rho) -> tuple[np.ndarray, np.ndarray]:
    """[Q, B] mean of rho^(gap - a) over the (use, age) pairs of each (class, age bucket), and their number."""
    B = len(lo)
    sums, counts = np.zeros((Q, B)), np.zeros((Q, B))
    for b in range(B):
        top = np.minimum(hi[b], gap)  # ages lo[b]..top of this gap fall in bucket b
        n = np.maximum(0, top - lo[b] + 1)
        # sum_{a = lo}^{top} rho^(gap - a), a geometric series; open gaps are worth 0.
        s = np.where(open_end | (n == 0), 0.0, rho ** (gap - top) * (1 - rho ** n) / (1 - rho))
        sums[:, b] = np.bincount(cls, weights=s, minlength=Q)
        counts[:, b] = np.bincount(cls, weights=n, minlength=Q)
    return sums / np.maximum(counts, 1), counts


_FITTED: dict[tuple[int, float, int, int], tuple[RoutingTrace, ReuseTable]] = {}


def fitted_reuse_table(train: RoutingTrace, tau: float, num_gap_classes: int, num_count_classes: int) -> ReuseTable:
    """`fit_reuse_table`, fitted once per training trace object (sweeps build many policies)."""
    key = (id(train), tau, num_gap_classes, num_count_classes)
    hit = _FITTED.get(key)
    if hit is None or hit[0] is not train:  # the trace is kept alive with its table: ids stay unique
        if len(_FITTED) >= 4:
            _FITTED.clear()
        hit = _FITTED[key] = (train, fit_reuse_table(train, tau, num_gap_classes=num_gap_classes,
                                                                num_count_classes=num_count_classes))
    return hit[1]

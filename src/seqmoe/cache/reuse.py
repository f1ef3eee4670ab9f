"""The learned prior of `ForecastPolicy` beyond its forecast: how soon an expert is used again.

`ReuseTable`, fitted on a training trace, gives E[discount of the wait until the next use] for an
expert unused for `a` tokens, by the expert's frequency class and by the gap between its last two
uses (bursts: an expert used twice in a row is likely used again soon).

    table = fit_reuse_table(train, tau)
    table.lookup(age_tokens, prev_gap_tokens) -> [L * E]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
        b = log2_bucket(age_tokens, self.values.shape[1])
        cls = self.uid_class * self.num_gap_classes
        if prev_gap_tokens is not None and self.num_gap_classes > 1:
            cls = cls + gap_class(prev_gap_tokens, self.num_gap_classes)
        return self.values[cls, b]


def log2_bucket(x: np.ndarray, n: int) -> np.ndarray:
    return np.minimum(np.log2(np.maximum(x, 1)).astype(np.int64), n - 1)


def gap_class(prev_gap: np.ndarray, n: int) -> np.ndarray:
    """0 for no earlier use, else 1 + log2 bucket of the gap (capped at n - 1)."""
    return np.where(prev_gap > 0, np.minimum(1 + log2_bucket(prev_gap, n), n - 1), 0)


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
    cls = uid_class[uid] * num_gap_classes + gap_class(prev_gap, num_gap_classes)
    for b in range(num_buckets):
        top = np.minimum(hi[b], gap)  # ages lo[b]..top of this gap fall in bucket b
        n = np.maximum(0, top - lo[b] + 1)
        # sum_{a = lo}^{top} rho^(gap - a), a geometric series; open gaps are worth 0.
        s = np.where(open_end | (n == 0), 0.0, rho ** (gap - top) * (1 - rho ** n) / (1 - rho))
        sums[:, b] = np.bincount(cls, weights=s, minlength=Q)
        counts[:, b] = np.bincount(cls, weights=n, minlength=Q)
    return ReuseTable(sums / np.maximum(counts, 1), uid_class.astype(np.int64), num_gap_classes)


_FITTED: dict[tuple[int, float, int], tuple[RoutingTrace, ReuseTable]] = {}


def fitted_reuse_table(train: RoutingTrace, tau: float, num_gap_classes: int) -> ReuseTable:
    """`fit_reuse_table`, fitted once per training trace object (sweeps build many policies)."""
    key = (id(train), tau, num_gap_classes)
    hit = _FITTED.get(key)
    if hit is None or hit[0] is not train:  # the trace is kept alive with its table: ids stay unique
        if len(_FITTED) >= 4:
            _FITTED.clear()
        hit = _FITTED[key] = (train, fit_reuse_table(train, tau, num_gap_classes=num_gap_classes))
    return hit[1]

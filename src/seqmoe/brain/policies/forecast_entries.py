"""Sparse forecast entries of `ForecastPolicy` and the probabilities derived from them.

A forecast is kept as entries (uid, step, p) of probability >= floor, sorted by uid then step.
`first_use` turns them into discounted first-use values and no-use probabilities per uid;
`EntriesAhead` holds the entries after one position with answers derived from them alone
(first forecast uses, which uids are likely used before a position), computed once per
(position, forecast).

P(no use at a uid's earlier entries) is a running product of (1 - p) in entry order, one
multiplication per entry (a certain entry, p = 1, makes it exactly 0): the same operations in the
same order as the compiled manager's loops (`seqmoe.brain.manager.compiled`), so both give the very
same numbers and the same decisions.
"""

from __future__ import annotations

import numpy as np


def _heads(uid: np.ndarray) -> np.ndarray:
    """[m] bool: the first entry of each uid (entries sorted by uid)."""
    head = np.empty(len(uid), dtype=bool)
    if len(uid):
        head[0] = True
        np.not_equal(uid[1:], uid[:-1], out=head[1:])
    return head


def running_stay(uid: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per entry (sorted by uid then step): P(no use at the uid's earlier entries) and P(no use up
    to and including this one), as sequential products of (1 - p) within each uid."""
    m = len(uid)
    stay = 1.0 - p
    after = stay.copy()  # the first entry of a uid: 1.0 * stay, exactly stay
    head = _heads(uid)
    if m:
        rank = np.arange(m) - np.maximum.accumulate(np.where(head, np.arange(m), 0))
        for r in range(1, int(rank.max()) + 1):
            at = np.flatnonzero(rank == r)
            after[at] = after[at - 1] * stay[at]
    before = np.ones(m)
    before[~head] = after[np.flatnonzero(~head) - 1]
    return before, after


class EntriesAhead:
    """Forecast entries after one position (by uid then step) and answers derived from them alone."""

    def __init__(self, key, uid, s, p, n: int) -> None:
        self.key, self.uid, self.s, self.p, self.n = key, uid, s, p, n
        self.before, self.after = running_stay(uid, p)
        self.head = _heads(uid)
        self._likely: dict = {}
        self._first: dict = {}

    def first_uses(self, min_prob: float) -> tuple[np.ndarray, np.ndarray]:
        hit = self._first.get(min_prob)
        if hit is None:
            m = self.p >= min_prob
            uid, s = self.uid[m], self.s[m]
            head = _heads(uid)
            hit = self._first[min_prob] = (uid[head], s[head])
        return hit

    def likely_before(self, step: int, max_harm: float) -> np.ndarray:
        """[n] bool: P(some entry before `step` is a use) > max_harm, i.e. the running P(no use)
        falls below 1 - max_harm at an entry before `step` (it only falls along a uid's entries)."""
        first = self._likely.get(max_harm)
        if first is None:
            like = self.after < 1.0 - max_harm
            at = like & (self.head | ~np.r_[False, like[:-1]])  # the first likely entry of each uid
            first = self._likely[max_harm] = np.full(self.n, np.iinfo(np.int64).max, dtype=np.int64)
            first[self.uid[at]] = self.s[at]
        return first < step


def no_entries() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)


def sparse_entries(steps: np.ndarray, probs: np.ndarray, L: int, E: int, floor: float):
    """Forecast entries of probability >= floor as (uid [n], step [n], p [n]), by uid then step."""
    probs = np.asarray(probs)
    r, e = np.nonzero(probs >= floor)
    uid = (steps[r] % L) * E + e
    order = np.argsort(uid, kind="stable")  # rows ascend, so steps ascend within a uid
    return uid[order], steps[r][order], np.minimum(probs[r, e][order].astype(np.float64), 1.0)


def first_use(uid, step, p, cur, tau, n, *, before=None, after=None, only=None):
    """Discounted first-use value and no-use probability per uid from sparse entries.

    Args:
        uid, step, p: [m] entries sorted by uid then step.
        cur: the position distances count from.
        tau: discount scale in positions.
        n: L * E.
        before, after: [m] `running_stay(uid, p)` when already at hand (the same numbers).
        only: [N] uids to return (default: all n); their numbers do not depend on it.

    Returns:
        value [n]: sum over entries of P(first use there) * exp(-(step - cur) / tau);
        survive [n]: P(no use at any entry).
    """
    if before is None:
        before, after = running_stay(uid, p)
    f = p * before  # P(first use at this entry)
    value = np.bincount(uid, weights=f * np.exp(-(step - cur) / tau), minlength=n)
    survive = np.ones(n)
    last = np.r_[uid[1:] != uid[:-1], True] if len(uid) else np.zeros(0, dtype=bool)
    survive[uid[last]] = after[last]
    if only is not None:
        value, survive = value[only], survive[only]
    return value, survive

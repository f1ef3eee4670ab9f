"""Sparse forecast entries of `ForecastPolicy` and the probabilities derived from them.

A forecast is kept as entries (uid, step, p) of probability >= floor, sorted by uid then step.
`first_use` turns them into discounted first-use values and no-use probabilities per uid;
`EntriesAhead` holds the entries after one position with answers derived from them alone
(first forecast uses, which uids are likely used before a position), computed once per
(position, forecast). Everything goes through numpy ufuncs elementwise, so the numbers do not
depend on how entries are grouped (the policy's decisions compare them exactly).
"""

from __future__ import annotations

import numpy as np


class EntriesAhead:
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
        """[n] bool: P(some entry before `step` is a use) > max_harm, exactly as `survival` of those
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


def entry_terms(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per forecast entry: whether it is certain (p >= 1) and log(1 - p) (0 where certain)."""
    certain = p >= 1.0  # log(1 - p) would be -inf: counted apart, exactly
    return certain, np.log1p(-np.where(certain, 0.0, p))


def no_entries() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)


def sparse_entries(steps: np.ndarray, probs: np.ndarray, L: int, E: int, floor: float):
    """Forecast entries of probability >= floor as (uid [n], step [n], p [n]), by uid then step."""
    probs = np.asarray(probs)
    r, e = np.nonzero(probs >= floor)
    uid = (steps[r] % L) * E + e
    order = np.argsort(uid, kind="stable")  # rows ascend, so steps ascend within a uid
    return uid[order], steps[r][order], np.minimum(probs[r, e][order].astype(np.float64), 1.0)


def survival(uid, p, n):
    """[n] probability that no entry (uid [m], p [m]) is a use, per uid (independence assumed)."""
    certain, log_stay = entry_terms(p)
    used = np.bincount(uid, weights=certain, minlength=n) > 0
    return np.where(used, 0.0, np.exp(np.bincount(uid, weights=log_stay, minlength=n)))


def first_use(uid, step, p, cur, tau, n, *, certain=None, log_stay=None, only=None):
    """Discounted first-use value and no-use probability per uid from sparse entries.

    Args:
        uid, step, p: [m] entries sorted by uid then step.
        cur: the position distances count from.
        tau: discount scale in positions.
        n: L * E.
        certain, log_stay: [m] `entry_terms(p)` when already at hand (the same numbers).
        only: [N] uids to return (default: all n); their numbers do not depend on it.

    Returns:
        value [n]: sum over entries of P(first use there) * exp(-(step - cur) / tau);
        survive [n]: P(no use at any entry).
    """
    if certain is None:
        certain, log_stay = entry_terms(p)
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

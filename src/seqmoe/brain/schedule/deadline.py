"""Prefetch scheduling as job sequencing with deadlines, driven by a forecast and ForecastPolicy.

Each candidate copy is a job: its deadline is when its layer starts computing (the view's `eta` at
the measured pace), its length the copy time, its profit the expected hits it adds (the forecast
probability that its expert is used) less the expected hits lost by evicting its victim when the
copy turns out wasted. The planner picks the most profitable set of copies that all finish by their
deadlines on the one channel.

    planned = plan_jobs(deadlines, profits, length=copy_s, start=channel_free_at)   # pure
    prefetcher = DeadlinePrefetcher(ForecastPolicy.from_trace(train))               # stateful

The prefetcher re-plans at every decision point (each token start, each layer's reveal and end)
but issues only the head of the plan, a few copies ahead of the channel: `view.prefetch` evicts the
victim at once, so a copy issued long before it runs commits its victim early, and a later plan
sees a newer forecast. Victims are chosen as Belady would choose them at each copy's own use
(docs/LOG.md: the "aggressive" oracle prefetch shows what evicting early costs).
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.policies.forecast import ForecastPolicy
from seqmoe.brain.predict.base import Forecast
from seqmoe.brain.schedule.base import PoolView, Prefetcher


def slots_by_deadline(deadlines: np.ndarray, length: float, start: float, limit: int) -> np.ndarray:
    """How many back-to-back copies from `start` finish by each deadline, capped at `limit`.

    Args:
        deadlines: [N] float seconds.
        length: seconds per copy.
        start: when the channel is free.
        limit: the cap (more slots than jobs are never needed).

    Returns:
        [N] int64, the largest n <= limit with `start + n * length <= deadline` (0 if none), the very
        arithmetic of an EDF check, so the greedy and a brute force agree on boundaries.
    """
    d = np.asarray(deadlines, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        n = np.floor((d - start) / length)
    n = np.minimum(np.fmax(n, 0.0), float(limit))  # nan -> 0, -inf -> 0, +inf -> limit
    n -= (n > 0) & (start + n * length > d)  # floor can be one off at exact multiples
    n += (n < limit) & (start + (n + 1) * length <= d)
    return n.astype(np.int64)


def plan_jobs(deadlines: np.ndarray, profits: np.ndarray, length: float, start: float) -> np.ndarray:
    """Job sequencing with deadlines for equal-length jobs: the most profitable feasible set.

    Greedy by profit: each job takes the latest free slot that still ends by its deadline
    (slots `[start + k * length, start + (k + 1) * length]`), found by union-find. Feasible sets
    of equal-length jobs form a matroid (a set is feasible iff, for every n, at most n of its jobs
    need to end within the first n slots), so this greedy is optimal. Jobs with profit <= 0 are
    never selected.

    Args:
        deadlines: [N] float seconds, when each job must have finished.
        profits: [N] float, what each job earns if it finishes in time.
        length: seconds per job (all equal).
        start: when the channel is free.

    Returns:
        [M] int64 indices of the selected jobs, earliest deadline first (ties by slot). Run back to
        back from `start` in this order, every one meets its deadline (EDF meets all deadlines of a
        set whenever any order does; the slot order can put a loose, profitable job last and a
        cheap one first, which matters when only the head of the plan is issued).
    """
    p = np.asarray(profits, dtype=np.float64)
    n = len(p)
    cap = slots_by_deadline(deadlines, length, start, n).tolist()
    parent = list(range(n + 1))  # parent chain of slot k leads to the latest free slot <= k; 0: none
    owner = [-1] * (n + 1)  # slots numbered 1..n
    for j in np.argsort(-p, kind="stable").tolist():
        if p[j] <= 0:
            break
        k = cap[j]
        root = k
        while parent[root] != root:
            root = parent[root]
        while parent[k] != root:  # path compression
            parent[k], k = root, parent[k]
        if root == 0:
            continue
        owner[root] = j
        parent[root] = root - 1
    chosen = np.array([j for j in owner[1:] if j >= 0], dtype=np.int64)  # slot order
    return chosen[np.argsort(np.asarray(deadlines, dtype=np.float64)[chosen], kind="stable")]


def plan_jobs_general(deadlines: np.ndarray, profits: np.ndarray, lengths: np.ndarray, start: float) -> np.ndarray:
    """Job sequencing with deadlines when lengths differ: a greedy, not always optimal.

    Maximising the profit of on-time jobs with unequal lengths (1 || sum w_j U_j) is NP-hard
    (Karp 1972; Lawler and Moore 1969 give a pseudo-polynomial DP). This takes jobs by profit
    density (profit / length), highest first, and keeps a job if the set stays feasible, checked by
    running it earliest deadline first (EDF meets every deadline iff any order does). With equal
    lengths it takes jobs in the same order as `plan_jobs` and keeps the same set, so it is optimal
    there.

    Args:
        deadlines: [N] float seconds.
        profits: [N] float (jobs with profit <= 0 are never selected).
        lengths: [N] float seconds per job.
        start: when the channel is free.

    Returns:
        [M] int64 indices of the selected jobs in EDF order (ties by index).
    """
    d = np.asarray(deadlines, dtype=np.float64)
    p, w = np.asarray(profits, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
    chosen: list[int] = []  # kept in EDF order
    for j in np.argsort(-(p / w), kind="stable").tolist():
        if p[j] <= 0:
            break
        trial = sorted(chosen + [j], key=lambda i: (d[i], i))
        if np.all(start + np.cumsum(w[trial]) <= d[trial]):
            chosen = trial
    return np.array(chosen, dtype=np.int64)


class DeadlinePrefetcher(Prefetcher):
    """Re-plan the copies as job sequencing with deadlines at every decision point; issue the head.

    Candidates are the absent uids forecast with probability >= `min_prob` at some coming position
    (the earliest such position gives the deadline). A copy adds the probability that its expert is
    used within the forecast (the expected hits it brings) and loses the keep value of the resident
    it displaces (about the probability of that one's next use, discounted) when the copy turns out
    wasted: the i-th most valuable candidate is paired with the i-th cheapest resident
    (`ForecastPolicy.cheapest`). Pairs whose profit is not above `margin` are dropped: `margin` is
    the break-even probability of a copy, by default the channel's measured busy share
    (`price_of_copy`). So are pairs where the newcomer's keep value is below its
    victim's (it would be the next one evicted: fetched too far ahead). `plan_jobs` picks the best
    set that can be on time from
    `view.backlog_end()`; jobs too late to be on time whatever happens stay too (a late copy still
    starts before the demand copy would). These are issued earliest deadline first, as long as
    the channel's backlog is shorter than the lead.

    Each issued copy displaces the resident this policy will rank cheapest *at the copy's own
    position* (Belady's victim then, with a certain forecast; `ForecastPolicy.victim_at`), and only
    once that resident is unlikely (<= `max_harm`) to be used before then: otherwise the copy waits
    for a later plan. Displacing the cheapest resident *now* instead evicts experts that a later
    layer would have freed anyway and costs extra copies ("aggressive" prefetching, docs/LOG.md).
    Queued copies whose expert a new forecast no longer expects are cancelled when the view
    offers `cancel(uid)`.

    Args:
        policy: the pool's eviction policy; it gets every forecast through `update`.
        min_prob: smallest forecast probability worth a job.
        margin: smallest profit (expected hits gained, `_profit`) worth a copy; None: priced at run
            time by `price_of_copy` from the share of time the channel is busy (`view.channel_use`).
        max_harm: largest probability that the displaced expert is used before the copy's position.
        max_jobs: most candidates planned per call (the channel rarely fits more within a horizon).
        max_tries: most planned jobs examined per call for issue.
        lead_copies: issue copies while the channel's backlog is shorter than this many copies;
            None: one layer at the measured pace (the next decision point comes sooner). A deeper
            queue hides more of the copy time (more ready hits) but commits victims earlier.
        replan_after_compute: plan again after each layer's compute, when its experts unpin. Off:
            the extra plans issued more copies and cost time on both workloads (docs/LOG.md).
    """

    def __init__(self, policy: ForecastPolicy, *, min_prob: float = 0.05, margin: float | None = None,
                 max_harm: float = 0.05, max_jobs: int = 64, max_tries: int = 8,
                 lead_copies: float | None = 4.0, replan_after_compute: bool = False) -> None:
        self.policy = policy
        self.replan_after_compute = replan_after_compute
        self.min_prob, self.margin, self.max_harm = min_prob, margin, max_harm
        self._margin = 0.5 if margin is None else margin  # the margin of the current plan
        self.max_jobs, self.max_tries, self.lead_copies = max_jobs, max_tries, lead_copies
        self._queued: dict[int, int] = {}  # uid -> position, prefetches issued and maybe still queued
        self._jobs_key: tuple | None = None  # (policy state, presence) the cached candidates hold for
        self._jobs_cache = None

    def plan(self, forecast: Forecast | None, view: PoolView) -> None:
        self.policy.update(forecast, view.step)  # None (after a layer's compute): keep the last one
        self._margin = price_of_copy(view.channel_use) if self.margin is None else self.margin
        if forecast is not None and self._queued and hasattr(view, "cancel"):
            self._cancel_stale(view)
        start, copy = view.backlog_end(), view.copy_time_s
        lead = self.lead_copies
        if lead is None:
            lead = (float(view.eta(view.step + 1)) - view.now) / copy
        room = int(np.ceil(lead - max(start - view.now, 0.0) / copy))  # copies starting within the lead
        if room <= 0:
            return
        jobs = self._jobs(view)
        if jobs is None:
            return
        uids, steps, value, profit = jobs
        deadlines = view.eta(steps)
        keep = slots_by_deadline(deadlines, copy, start, 1) == 0  # late whatever we do: still worth it
        keep[plan_jobs(deadlines, profit, copy, start)] = True  # the best set that can be on time
        # Issue earliest deadline first: copies then arrive in the order of use, so each one's victim
        # is chosen as Belady would choose it at that use (issuing a later use first takes a
        # victim the earlier one needed, and costs copies).
        order = np.flatnonzero(keep)
        order = order[np.argsort(deadlines[order], kind="stable")]
        victims: dict[int, tuple[int | None, bool]] = {}  # per position; valid until a copy is issued
        for j in order[: self.max_tries].tolist():
            step = int(steps[j])
            if step not in victims:
                victims[step] = self.policy.victim_at(step, self.max_harm)
            if self._issue(view, int(uids[j]), step, value[j], *victims[step]):
                victims.clear()
                room -= 1
                if room == 0:
                    break

    def _issue(self, view: PoolView, uid: int, step: int, value: float, victim: int | None, wait: bool) -> bool:
        """Prefetch `uid` for position `step` unless its victim there (`victim_at`) must wait."""
        if wait:
            return False
        if victim is not None:
            cost = self.policy.keep_value(victim)
            if _profit(value, cost) <= self._margin or self.policy.keep_value(uid) <= cost:
                return False
        if not view.prefetch(uid, step, victim):
            return False  # the victim is pinned
        self._queued[uid] = step
        return True

    def _cancel_stale(self, view) -> None:
        """Cancel queued prefetches the new forecast no longer expects (p < `min_prob` everywhere).

        Needs `view.cancel(uid) -> bool` (drop a copy that has not started and free its slot).
        """
        uids, _ = self.policy.first_uses(self.min_prob)
        expected = set(uids.tolist())
        for uid, step in list(self._queued.items()):
            if step <= view.step:
                del self._queued[uid]  # its layer has routed
            elif uid not in expected:
                view.cancel(uid)  # False once the copy has started: then it simply runs
                del self._queued[uid]

    def _jobs(self, view: PoolView):
        """Candidate copies: uids [N], deadline steps [N], keep values [N], profits [N]; or None.

        They depend on the policy's state and the presence of each uid only: kept while neither changes.
        """
        key = (self.policy.state_key(), view.present_mask().tobytes(), self.min_prob, self._margin, self.max_jobs)
        if key != self._jobs_key:
            self._jobs_cache = self._find_jobs(view)
            self._jobs_key = key
        return self._jobs_cache

    def _find_jobs(self, view: PoolView):
        uids, steps = self.policy.first_uses(self.min_prob)
        absent = view.present_mask()[uids] == 0
        uids, steps = uids[absent], steps[absent]
        if not len(uids):
            return None
        # The most valuable to keep (likely and near) first; the cheapest residents pair with them.
        keep = self.policy.keep_value(uids)
        top = np.argsort(-keep, kind="stable")[: self.max_jobs]
        _, cost = self.policy.cheapest(len(top))
        top = top[: len(cost)]
        value = self.policy.use_prob(uids[top])  # expected hits a copy adds (kept until its use)
        profit = _profit(value, cost)
        # Do no harm: the newcomer must be worth more than its victim, else it would be the next
        # one evicted (a copy fetched too far ahead of its use).
        ok = (profit > self._margin) & (keep[top] > cost)
        top = top[ok]
        return uids[top], steps[top], value[ok], profit[ok]


MIN_MARGIN, MAX_MARGIN = 0.5, 0.95
"""The price of a copy stays within these: a copy more likely wasted than used is never worth its
victim, and a certain forecast is always worth its copy."""


def price_of_copy(channel_use: float) -> float:
    """The break-even probability of a prefetch when the channel is busy `channel_use` of the time.

    A used prefetch saves the part of its copy that runs while the channel would otherwise idle,
    (1 - u) of a copy on average; a wasted one costs the channel time other copies would have used,
    u of a copy. p (1 - u) = (1 - p) u gives p = u: on a saturated channel only near-certain copies
    pay (docs/LOG.md: the best fixed margins track u).
    """
    return min(max(channel_use, MIN_MARGIN), MAX_MARGIN)


def _profit(use_prob, victim_keep):
    """Expected hits a copy gains: its own use, less the victim's worth when the copy is wasted.

    When the newcomer is used, its victim (chosen so that it is not needed before then) would have
    been evicted for it anyway, by a demand copy; only a wasted copy loses the victim for nothing.
    """
    return use_prob - (1.0 - use_prob) * victim_keep

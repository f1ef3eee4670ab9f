"""Prefetch scheduling as job sequencing with deadlines, driven by a forecast and ForecastPolicy.

Each candidate copy is a job: its deadline is when its layer starts computing (the view's `eta` at
the measured pace), its length the copy time, its profit the keep value it brings (the policy's
discounted probability of use) minus the keep value of the resident it displaces. The planner picks
the most profitable set of copies that all finish by their deadlines on the one channel.

    planned = plan_jobs(deadlines, profits, length=copy_s, start=channel_free_at)   # pure
    prefetcher = DeadlinePrefetcher(ForecastPolicy.from_trace(train))               # stateful

The prefetcher re-plans at every decision point (each token start, each layer's reveal and end)
but issues only the head of the plan, the copies the channel would start before the next decision
point: `view.prefetch` evicts the victim at once, so a copy issued long before it runs evicts too
early (docs/LOG.md, "aggressive" oracle prefetch), and a later plan sees a newer forecast.
"""

from __future__ import annotations

import numpy as np

from seqmoe.cache.forecast import ForecastPolicy
from seqmoe.predict.base import Forecast
from seqmoe.schedule.base import PoolView


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
    n = np.clip(np.nan_to_num(n, nan=0.0, posinf=limit, neginf=0.0), 0, limit)
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
    lengths it makes the same choices as `plan_jobs`, so it is optimal there.

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


class DeadlinePrefetcher:
    """Re-plan the copies as job sequencing with deadlines at every decision point; issue the head.

    Candidates are the absent uids forecast with probability >= `min_prob` at some coming position
    (the earliest such position gives the deadline). The i-th most valuable candidate is paired with
    the i-th cheapest resident (`ForecastPolicy.cheapest`); its profit is the difference of their
    keep values, and pairs not above `margin` are dropped. `plan_jobs` chooses and orders the
    on-time jobs from `view.backlog_end()`; the jobs that cannot be on time follow, earliest
    deadline first (a late copy still starts before the demand copy would). Only as many copies
    as the channel starts within the lead are issued.

    Each issued copy displaces the resident Belady would evict *at the copy's own position* (lowest
    keep value counting uses from then on, `ForecastPolicy.victim_at`), and only once that resident is
    unlikely (<= `max_harm`) to be used before then: otherwise the copy waits for a later plan.
    Displacing the cheapest resident *now* instead evicts experts that a later layer would have
    freed anyway and costs extra copies ("aggressive" prefetching, docs/LOG.md).

    Args:
        policy: the pool's eviction policy; it gets every forecast through `update`.
        min_prob: smallest forecast probability worth a job.
        margin: smallest profit (in keep-value units) worth a copy.
        max_harm: largest probability that the displaced expert is used before the copy's position.
        max_jobs: most candidates planned per call (the channel rarely fits more within a horizon).
        max_tries: most planned jobs examined per call for issue.
        lead_copies: issue copies while the channel's backlog is shorter than this many copies;
            None: one layer at the measured pace (the next decision point comes sooner). A deeper
            queue hides more of the copy time (more ready hits) but commits victims earlier.
    """

    replan_after_compute = True  # a layer's experts unpin when it finishes: new victims

    def __init__(self, policy: ForecastPolicy, *, min_prob: float = 0.05, margin: float = 0.0,
                 max_harm: float = 0.05, max_jobs: int = 64, max_tries: int = 4,
                 lead_copies: float | None = None) -> None:
        self.policy = policy
        self.min_prob, self.margin, self.max_harm = min_prob, margin, max_harm
        self.max_jobs, self.max_tries, self.lead_copies = max_jobs, max_tries, lead_copies

    def plan(self, forecast: Forecast | None, view: PoolView) -> None:
        self.policy.update(forecast, view.step)  # None (after a layer's compute): keep the last one
        start, copy = view.backlog_end(), view.copy_time_s
        if self.lead_copies is None:
            lead = float(view.eta(view.step + 1)) - view.now
        else:
            lead = self.lead_copies * copy
        room = int(np.ceil((view.now + lead - start) / copy))  # slots that start before now + lead
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
        for j in order[: self.max_tries].tolist():
            if self._issue(view, int(uids[j]), int(steps[j]), value[j]):
                room -= 1
                if room == 0:
                    break

    def _issue(self, view: PoolView, uid: int, step: int, value: float) -> bool:
        """Prefetch `uid` for position `step` if its victim at that position is free now."""
        victim, wait = self.policy.victim_at(step, self.max_harm)
        if wait or (victim is not None and value - self.policy.keep_value(victim) <= self.margin):
            return False
        return view.prefetch(uid, step, victim)  # False while the victim is pinned

    def _jobs(self, view: PoolView):
        """Candidate copies: uids [N], deadline steps [N], keep values [N], profits [N]; or None."""
        uids, steps = self.policy.first_uses(self.min_prob)
        absent = view.present_mask()[uids] == 0
        uids, steps = uids[absent], steps[absent]
        if not len(uids):
            return None
        value = self.policy.keep_value(uids)
        top = np.argsort(-value, kind="stable")[: self.max_jobs]
        _, cost = self.policy.cheapest(len(top))
        top = top[: len(cost)]
        profit = value[top] - cost
        ok = profit > self.margin  # a prefix: value falls and cost rises along `top`
        top = top[ok]
        return uids[top], steps[top], value[top], profit[ok]

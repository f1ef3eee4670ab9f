"""Greedy prefetch: the most likely experts first, as long as the channel can deliver them in time.

Used by the prediction baselines. Candidates are (position, expert) pairs whose forecast
probability reaches `min_prob`; their priority is the probability, optionally decayed with
distance (MoE-Infinity prioritises closer layers). A candidate is issued only if, queued behind
everything already on the channel, its copy would finish before its layer starts.
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.predict.base import Forecast
from seqmoe.brain.schedule.base import PoolView, Prefetcher


def rank_candidates(forecast: Forecast, num_layers: int, min_prob: float, decay: bool) -> tuple[np.ndarray, np.ndarray]:
    """Order forecast entries by priority.

    Args:
        forecast: steps [H] int64, probs [H, E] float.
        num_layers: L, to map a position to its layer.
        min_prob: entries below this probability are dropped.
        decay: multiply by (1 - h / H) for the h-th position ahead.

    Returns:
        uids [N] int64 and deadline steps [N] int64, highest priority first (stable on ties).
    """
    H, E = forecast.probs.shape
    h, e = np.nonzero(forecast.probs >= min_prob)
    prio = forecast.probs[h, e]
    if decay:
        prio = prio * (1.0 - h / H)
    order = np.argsort(-prio, kind="stable")
    steps = forecast.steps[h[order]]
    return (steps % num_layers) * E + e[order], steps


class GreedyPrefetcher(Prefetcher):
    """Issue likely experts in priority order while they can still arrive before their layer."""

    def __init__(self, *, min_prob: float = 0.2, decay: bool = False) -> None:
        self.min_prob, self.decay = min_prob, decay

    def plan(self, forecast: Forecast | None, view: PoolView) -> None:
        if forecast is None or not len(forecast.steps):
            return
        uids, steps = rank_candidates(forecast, view.num_layers, self.min_prob, self.decay)
        absent = view.present_mask()[uids] == 0
        uids, steps = uids[absent], steps[absent]
        if not len(uids):
            return
        t_free, copy = view.backlog_end(), view.copy_time_s
        for uid, step, eta in zip(uids.tolist(), steps.tolist(), view.eta(steps).tolist()):
            if t_free + copy > eta or view.present(uid):  # too late, or issued for an earlier step
                continue
            if not view.prefetch(uid, step):
                break
            t_free += copy


class InsertBeforeLayer(Prefetcher):
    """MoE-Beyond's rule: the next position's predicted experts enter the pool before it, each made most
    recent in `policy` (an LRU) whether it was resident or not; nothing further ahead is fetched."""

    def __init__(self, policy, *, min_prob: float = 0.5) -> None:
        self.policy, self.min_prob = policy, min_prob

    def plan(self, forecast: Forecast | None, view: PoolView) -> None:
        if forecast is None or not len(forecast.steps) or forecast.steps[0] != view.step + 1:
            return
        step = int(forecast.steps[0])
        base = (step % view.num_layers) * view.num_experts
        for e in np.flatnonzero(forecast.probs[0] >= self.min_prob).tolist():
            uid = base + e
            if view.present(uid):
                self.policy.access(uid, step)
            elif not view.prefetch(uid, step):
                break

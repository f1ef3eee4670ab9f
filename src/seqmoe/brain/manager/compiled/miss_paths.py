"""The miss paths of `seqmoe.brain.manager.miss_paths`, compiled: which path serves a miss (`auto_path`'s rule,
decision for decision), the misses the twins serve, the host CPU's lane, and a miss served off the pool."""

from __future__ import annotations

import numba as nb
import numpy as np

import seqmoe.brain.manager.compiled.channel as channel
import seqmoe.brain.manager.compiled.ops as ops
from seqmoe.brain.manager.compiled.forecast import keep_values
from seqmoe.brain.manager.compiled.layout import (
    CAP, EV_OFF_POOL, HOST, HOST_END, HOST_S, HOST_SERVED, IN_PLACE, LANE_FREE, MISS, MISS_AUTO, MISS_COPY, MISS_CPU,
    MISS_IN_PLACE, NUM_PRESENT, PATH_CPU_COPY, PATH_TWIN, POLICY, POLICY_LRU, PRESENT, TWIN_LEFT, TWIN_W,
    TWINS,
)
from seqmoe.brain.manager.compiled.policies import policy_victim
import seqmoe.brain.manager.miss_paths as paths
from seqmoe.brain.manager.compiled.recency import policy_access

jit = nb.njit(cache=True)
OFF_IN_PLACE, OFF_CPU, OFF_TWIN = (paths.OFF_POOL.index(p) for p in (paths.IN_PLACE, paths.CPU, paths.TWIN))


@jit
def _worth_a_slot(I, F, S, G, TAB, DISC, u):
    """(whether u is worth a slot: a free one, or the policy's victim's, valued lower; the victim or -1)."""
    if S[NUM_PRESENT] < S[CAP]:
        return True, -1
    v = policy_victim(I, F, S, G, TAB, DISC)
    if v < 0:
        return False, -1
    if S[POLICY] == POLICY_LRU:  # values no expert: a slot is always worth taking
        return True, v
    values = keep_values(I, F, S, G, TAB, DISC)
    return values[u] > values[v], v


@jit
def choose(I, F, S, G, DQ, TAB, DISC, u, now):
    """(path, victim) of the miss of `u` at `now`: S[MISS] unless auto, else `auto_path`'s choice
    (MISS_* or PATH_CPU_COPY; victim -1: the policy picks, or no copy)."""
    if S[MISS] != MISS_AUTO:
        return S[MISS], -1
    link = channel.next_demand_end(I, S, G, DQ, now)
    on_cpu = max(G[LANE_FREE], now) + G[HOST_S] < link
    worth, victim = _worth_a_slot(I, F, S, G, TAB, DISC, u)
    if on_cpu:
        if worth and channel.backlog_end(S, G, now) <= now:
            return PATH_CPU_COPY, victim
        return MISS_CPU, -1
    if worth:
        return MISS_COPY, victim
    return MISS_IN_PLACE, -1


@jit
def pick_twins(I, G, needed, weights):
    """[K] bool: the misses of `needed` their twins may serve, smallest `weights` first while their
    sum stays within G[TWIN_LEFT] (`seqmoe.brain.manager.miss_paths.pick_twins`, the same sums in the same order)."""
    twins = np.zeros(len(needed), dtype=np.bool_)
    spent = 0.0
    while True:
        best = -1
        for i in range(len(needed)):
            if not twins[i] and not I[PRESENT, needed[i]] and (best < 0 or weights[i] < weights[best]):
                best = i
        if best < 0 or spent + weights[best] > G[TWIN_LEFT]:
            return twins
        spent += weights[best]
        twins[best] = True


@jit
def twin_serves(I, S, G, DQ, w, now):
    """Whether a miss `pick_twins` marked, of gate weight `w`, reads its twin (unless the host CPU
    would finish it first: `seqmoe.brain.manager.miss_paths.twin_waits_for_cpu`); spends `w` when it does."""
    if S[MISS] == MISS_CPU or S[MISS] == MISS_AUTO:
        if max(G[LANE_FREE], now) + G[HOST_S] < channel.next_demand_end(I, S, G, DQ, now, True):
            return False
    G[TWIN_LEFT] -= w
    G[TWIN_W] += w
    S[TWINS] += 1
    return True


@jit
def on_host(S, G, EV, u, now):
    """Serve `u` on the host CPU from `now` (`ManagerBase._on_host`)."""
    G[HOST_END] = max(G[LANE_FREE], now) + G[HOST_S]
    G[LANE_FREE] = G[HOST_END]
    S[HOST_SERVED] += 1
    S[HOST] += 1
    ops.event(S, EV, EV_OFF_POOL, u, OFF_CPU)


@jit
def off_pool(I, F, S, G, DQ, PH, RQI, RQF, EV, u, path, step, now):
    """Serve the miss of `u` on the host CPU, by an in-place read or (`path` PATH_TWIN) by a read of
    its twin; the policy hears of the use (`note_use`: forecast policies). Returns whether a read was queued."""
    read = path != MISS_CPU
    if path == PATH_TWIN:
        channel.read(I, F, S, G, DQ, PH, RQI, RQF, u, now, True)
        ops.event(S, EV, EV_OFF_POOL, u, OFF_TWIN)
    elif read:
        channel.read(I, F, S, G, DQ, PH, RQI, RQF, u, now, False)
        S[IN_PLACE] += 1
        ops.event(S, EV, EV_OFF_POOL, u, OFF_IN_PLACE)
    else:
        on_host(S, G, EV, u, now)
    if S[POLICY] != POLICY_LRU:
        policy_access(I, F, S, u, step)
    return read

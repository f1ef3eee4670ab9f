"""The decision points of `seqmoe.brain.manager.state.MemoryManager`, compiled: a layer's reveal (serve
its K experts, then the scheduler plans), a layer's end and a token's start (the scheduler plans).

The predictor stays in Python between `serve` and `decide` (which loads its forecast and plans);
everything else of a decision point is one call.
"""

from __future__ import annotations

import numba as nb
import numpy as np

import seqmoe.brain.manager.compiled.deadline as deadline
import seqmoe.brain.manager.compiled.channel as channel
import seqmoe.brain.manager.compiled.forecast as forecast
import seqmoe.brain.manager.compiled.ops as ops
import seqmoe.brain.manager.compiled.miss_paths as miss_paths
from seqmoe.brain.manager.compiled.layout import (
    ADDED, CAP, DONE_AT, EV_PROMOTE, FINISH, HOST, IN_PLACE, LATE, LAYER_S, L_, MISS, MISSES, MISS_COPY, NOW, NUM_PRESENT,
    MISS_CPU, MISS_IN_PLACE, PACE, PACE_WEIGHT, PATH_CPU_COPY, PATH_TWIN, PENDING, PINNED, POL_STEP, PREFETCHER, PREFETCH_DEADLINE, PRESENT, READS_END,
    READY, STALL, STEP, UNUSED_PF,
)
from seqmoe.brain.manager.compiled.forecast import demand_victims
from seqmoe.brain.manager.compiled.recency import policy_access

jit = nb.njit(cache=True)


@jit
def _reclaim_prefetch(I, S, PH, EV, needed):
    """Every slot is pinned: cancel the queued prefetch needed last and take its slot."""
    uid = channel.cancel_latest_prefetch(I, S, PH, needed)
    if uid < 0:
        return False
    ops.free_cancelled(I, S, EV, uid)
    return True


@jit
def _await_running(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, needed, buf):
    """Every slot holds this layer's experts or a copy already started: let the running copy land
    first (`MemoryManager._await_running`) and make room."""
    t = channel.running_until(S, RQF)
    if t == -np.inf:
        return False
    for i in range(channel.advance(I, F, S, G, DQ, PH, RQI, RQF, t, buf)):
        u = buf[i]
        if u < 0:  # an in-place read
            continue
        I[PENDING, u] = 0
        mine = False
        for k in needed:
            mine = mine or k == u
        if mine:
            I[ADDED, u] = 1  # unpinned with the layer's other experts at its end
        else:
            I[PINNED, u] = 0
    return ops.make_room(I, F, S, G, EV, TAB, DISC, -1)


@jit
def serve(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, needed, mult, weights, step, reveal, buf, finish):
    """The router of the layer at `step` revealed `needed` (distinct uids: K at batch 1) at time
    `reveal`, `mult[i]` activations of `needed[i]` (the rows routed to it), with gate `weights`
    ([K] float64, read by the twin path; empty without one): count hits and misses per activation,
    queue one demand copy or read per expert, and `finish_layer` when `finish` (no decisions come
    in between). Returns the time its experts can start."""
    S[STEP] = step
    G[NOW] = reveal
    ops.finish_copies(I, F, S, G, DQ, PH, RQI, RQF, reveal, buf)
    G[READS_END] = -np.inf
    for u in needed:
        if not I[PINNED, u]:
            I[ADDED, u] = 1
            I[PINNED, u] = 1
    start = reveal
    waiting = np.empty(len(needed), dtype=np.int64)
    nw = 0
    for i in range(len(needed)):
        u = needed[i]
        if not I[PRESENT, u]:
            continue
        if I[PENDING, u]:  # issued before the reveal: a hit, late
            S[LATE] += mult[i]
            done = F[DONE_AT, u]
            if done != done:  # still queued: the layer needs it now
                channel.demand(I, F, S, G, DQ, PH, RQI, RQF, u, reveal)
                waiting[nw] = u
                nw += 1
                ops.event(S, EV, EV_PROMOTE, u, 0)
            elif done > start:
                start = done
        else:
            S[READY] += mult[i]
        I[UNUSED_PF, u] = 0
        policy_access(I, F, S, u, step)
    twins = miss_paths.pick_twins(I, G, needed, weights) if len(weights) else np.zeros(len(needed), np.bool_)
    queue = np.empty(len(needed), dtype=np.int64)  # the forecast policy's demand victims, in order
    nq, qi, misses, reads = 0, 0, 0, 0
    for i in range(len(needed)):  # the misses that take a slot (under MISS_COPY every twin marked reads)
        misses += not I[PRESENT, needed[i]] and not twins[i]
    for i in range(len(needed)):
        u = needed[i]
        if I[PRESENT, u]:
            continue
        S[MISSES] += mult[i]
        victim = -1
        if twins[i] and miss_paths.twin_serves(I, S, G, DQ, weights[i], reveal):
            reads += miss_paths.off_pool(I, F, S, G, DQ, PH, RQI, RQF, EV, u, PATH_TWIN, step, reveal)
            continue
        if S[MISS] != MISS_COPY:  # the miss paths (`seqmoe.brain.manager.miss_paths`)
            path, victim = miss_paths.choose(I, F, S, G, DQ, TAB, DISC, u, reveal)
            if path == PATH_CPU_COPY:  # the policy hears of the use when the copy lands
                miss_paths.on_host(S, G, EV, u, reveal)
                S[HOST] += mult[i] - 1  # one pass over the expert serves its rows; counts are per activation
                ops.prefetch(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, u, step + S[L_], victim)
                continue
            if path != MISS_COPY:
                reads += miss_paths.off_pool(I, F, S, G, DQ, PH, RQI, RQF, EV, u, path, step, reveal)
                S[HOST if path == MISS_CPU else IN_PLACE] += mult[i] - 1
                continue
        # The victims can be listed once the policy stands at this position (keep values stay then).
        elif S[NUM_PRESENT] >= S[CAP] and nq >= 0 and S[POL_STEP] == step:
            if qi == nq:  # list the layer's victims (see `demand_victims`)
                nq, qi = demand_victims(I, F, S, G, TAB, DISC, misses, queue), 0
            while 0 <= qi < nq and (not I[PRESENT, queue[qi]] or I[PINNED, queue[qi]]):
                qi += 1
            if 0 <= qi < nq:
                victim = queue[qi]
                qi += 1
        misses -= 1
        if not (ops.make_room(I, F, S, G, EV, TAB, DISC, victim) or _reclaim_prefetch(I, S, PH, EV, needed)):
            nq = -1  # the slow paths change what is pinned: ask the policy from here on
            if not _await_running(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, needed, buf):
                # Every slot holds this layer's experts or a copy in flight: read the row in place.
                reads += miss_paths.off_pool(I, F, S, G, DQ, PH, RQI, RQF, EV, u, MISS_IN_PLACE, step, reveal)
                S[IN_PLACE] += mult[i] - 1
                continue
        ops.demand_load(I, F, S, G, DQ, PH, RQI, RQF, EV, u, step, reveal)
        policy_access(I, F, S, u, step)
        waiting[nw] = u
        nw += 1
    if nw or reads:
        for i in range(nw):
            F[FINISH, waiting[i]] = np.nan
        channel.demand_finish_times(I, F, S, G, DQ)
        start = max(start, G[READS_END])
        for i in range(nw):
            u = waiting[i]
            t = F[FINISH, u]
            if t != t:
                t = F[DONE_AT, u]
                if t != t:
                    t = reveal
            if t > start:
                start = t
    if finish:
        finish_layer(I, G, needed, reveal, start)
    return start


@jit
def finish_layer(I, G, needed, reveal, start):
    """After the decisions of a reveal: the layer's experts unpin unless still copying; stall and pace."""
    for u in needed:
        if I[ADDED, u]:
            I[ADDED, u] = 0
            if not I[PENDING, u]:
                I[PINNED, u] = 0
    G[STALL] += start - reveal
    # The pace includes stalls, so deadlines follow the speed the run really has.
    G[PACE] += G[PACE_WEIGHT] * (G[LAYER_S] + start - reveal - G[PACE])


@jit
def decide(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, JI, JF, WF, MI, new_forecast, steps, probs, floor):
    """The scheduler's part of a decision point: load the new forecast (if `new_forecast`) and plan.
    Returns False when the forecast does not fit the compiled policy (see `forecast.load_forecast`)."""
    if new_forecast and not forecast.load_forecast(I, F, S, steps, probs, floor):
        return False
    if S[PREFETCHER] == PREFETCH_DEADLINE:
        deadline.plan(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, JI, JF, WF, MI, new_forecast)
    return True


@jit
def move_to(I, F, S, G, DQ, PH, RQI, RQF, step, now, buf):
    """A decision point at position `step` and time `now` without a reveal (token start, layer end)."""
    S[STEP] = step
    G[NOW] = now
    ops.finish_copies(I, F, S, G, DQ, PH, RQI, RQF, now, buf)


@jit
def end_layer(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, JI, JF, WF, MI, step, now, buf):
    """The layer at `step` finished computing at `now`: its experts unpin, the scheduler plans again."""
    move_to(I, F, S, G, DQ, PH, RQI, RQF, step, now, buf)
    if S[PREFETCHER] == PREFETCH_DEADLINE:
        deadline.plan(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, JI, JF, WF, MI, False)


@jit
def layer(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, JI, JF, WF, MI, needed, mult, weights, step, reveal, buf,
          new_forecast, steps, probs, floor):
    """`serve`, `decide` and `finish_layer` of a reveal in one call (the first call after the model's
    forward costs ~20 us of cold caches in the runtime, the next ones ~1). Returns (the time
    the layer's experts can start, whether the forecast fit)."""
    start = serve(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, needed, mult, weights, step, reveal, buf, False)
    ok = decide(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, JI, JF, WF, MI, new_forecast, steps, probs, floor)
    finish_layer(I, G, needed, reveal, start)
    return start, ok

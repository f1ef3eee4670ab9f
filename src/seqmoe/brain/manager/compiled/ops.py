"""The state machine's own operations on the compiled state (`seqmoe.brain.manager.state.MemoryManager`'s
private methods): loads, evictions, cancellations and prefetches, each recording its event for
the observer."""

from __future__ import annotations

import numba as nb

import seqmoe.brain.manager.compiled.channel as channel
from seqmoe.brain.manager.compiled.layout import (
    CANCELLED, CAP, EV_DEMAND, EV_EVICT, EV_PREFETCH, NEV, NOW, NUM_PRESENT, PENDING, PINNED, PREFETCHES, PRESENT,
    RES, RES_AT, STEP, UNUSED_PF, WASTED,
)
from seqmoe.brain.manager.compiled.policies import policy_victim
from seqmoe.brain.manager.compiled.recency import policy_insert, policy_remove

jit = nb.njit(cache=True)


@jit
def event(S, EV, kind, uid, deadline):
    i = S[NEV]
    EV[i, 0], EV[i, 1], EV[i, 2] = kind, uid, deadline
    S[NEV] = i + 1


@jit
def finish_copies(I, F, S, G, DQ, PH, RQI, RQF, t, buf):
    """Advance the channel to `t`; finished copies stop being pending and pinned."""
    for i in range(channel.advance(I, F, S, G, DQ, PH, RQI, RQF, t, buf)):
        u = buf[i]
        if u >= 0:  # not an in-place read
            I[PENDING, u] = 0
            I[PINNED, u] = 0


@jit
def make_room(I, F, S, G, EV, TAB, DISC, victim):
    """Free a slot when the pool is full: evict `victim` (if resident and unpinned; -1: the policy's
    choice). False when no slot can be freed."""
    if S[NUM_PRESENT] < S[CAP]:
        return True
    if victim >= 0 and I[PRESENT, victim]:
        if I[PINNED, victim]:
            return False
        v = victim
    else:
        v = policy_victim(I, F, S, G, TAB, DISC)
    if v < 0:
        return False
    policy_remove(I, S, v)
    absent(I, S, v)
    event(S, EV, EV_EVICT, v, 0)
    if I[UNUSED_PF, v]:
        I[UNUSED_PF, v] = 0
        S[WASTED] += 1
    return True


@jit
def free_cancelled(I, S, EV, uid):
    """A queued prefetch of `uid` was cancelled before its copy started: give its slot back."""
    policy_remove(I, S, uid)
    absent(I, S, uid)
    I[UNUSED_PF, uid] = I[PENDING, uid] = I[PINNED, uid] = 0
    S[CANCELLED] += 1
    event(S, EV, EV_EVICT, uid, 0)


@jit
def present(I, S, uid):
    """uid becomes PRESENT: it joins the RES list."""
    n = S[NUM_PRESENT]
    I[PRESENT, uid] = 1
    I[RES, n], I[RES_AT, uid] = uid, n
    S[NUM_PRESENT] = n + 1


@jit
def absent(I, S, uid):
    """uid stops being PRESENT: the last of RES takes its place there."""
    n, i = S[NUM_PRESENT] - 1, I[RES_AT, uid]
    last = I[RES, n]
    I[RES, i], I[RES_AT, last] = last, i
    I[RES_AT, uid] = -1
    I[PRESENT, uid] = 0
    S[NUM_PRESENT] = n


@jit
def load(I, S, uid, step):
    present(I, S, uid)
    I[PENDING, uid] = 1
    I[PINNED, uid] = 1
    policy_insert(I, S, uid, step)


@jit
def prefetch(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, uid, deadline_step, victim):
    """`PoolView.prefetch`: reserve a slot for `uid` (evicting `victim` or the policy's choice) and queue its copy."""
    if I[PRESENT, uid]:
        return True
    if not make_room(I, F, S, G, EV, TAB, DISC, victim):
        return False
    load(I, S, uid, S[STEP])
    I[UNUSED_PF, uid] = 1
    S[PREFETCHES] += 1
    channel.prefetch(I, F, S, G, DQ, PH, RQI, RQF, uid, deadline_step, G[NOW])
    event(S, EV, EV_PREFETCH, uid, deadline_step)
    return True


@jit
def cancel(I, S, EV, uid):
    """`PoolView.cancel`: drop the queued prefetch of `uid` and free its slot; False if not a queued prefetch."""
    if not I[PENDING, uid] or not I[UNUSED_PF, uid] or not channel.cancel(I, S, uid):
        return False
    free_cancelled(I, S, EV, uid)
    return True


@jit
def demand_load(I, F, S, G, DQ, PH, RQI, RQF, EV, uid, step, reveal):
    load(I, S, uid, step)
    channel.demand(I, F, S, G, DQ, PH, RQI, RQF, uid, reveal)
    event(S, EV, EV_DEMAND, uid, step)

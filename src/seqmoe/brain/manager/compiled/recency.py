"""Recency bookkeeping of the compiled policies over the arrays of `layout`: the LRU list (a
doubly linked list, oldest at the head) and the ticks, positions and gaps the forecast policy reads."""

from __future__ import annotations

import numba as nb

from seqmoe.brain.manager.compiled.layout import (
    AHEAD_STEP, AHEAD_VERSION, COSTS_STEP, DIRTY, FU_VERSION, F_FIRST, F_LAST, LAST_STEP, LAST_USE, LRU_HEAD,
    LRU_NEXT, LRU_PREV, LRU_TAIL, MUT, NDIRTY, NUM_COUNT_CLASSES, NUM_GAP_CLASSES, NUM_PRESENT, PINNED, POLICY,
    POLICY_LRU, POL_STEP, PREV_GAP, PRIOR_END, RECENT, RES, TICK, TICKS, UCLASS, UROW, VAL_STEP, VAL_VERSION, VERSION,
)
from seqmoe.brain.manager.compiled.prior import record_use

jit = nb.njit(cache=True)
NOT_LISTED = -2  # LRU_PREV of a uid outside the LRU list
NEVER = -(1 << 40)  # a cache key no position or forecast has


@jit
def _lru_unlink(I, S, u):
    p, n = I[LRU_PREV, u], I[LRU_NEXT, u]
    if p >= 0:
        I[LRU_NEXT, p] = n
    else:
        S[LRU_HEAD] = n
    if n >= 0:
        I[LRU_PREV, n] = p
    else:
        S[LRU_TAIL] = p
    I[LRU_PREV, u] = NOT_LISTED


@jit
def _lru_append(I, S, u):
    if I[LRU_PREV, u] != NOT_LISTED:
        _lru_unlink(I, S, u)
    t = S[LRU_TAIL]
    I[LRU_PREV, u], I[LRU_NEXT, u] = t, -1
    if t >= 0:
        I[LRU_NEXT, t] = u
    else:
        S[LRU_HEAD] = u
    S[LRU_TAIL] = u


@jit
def lru_victim(I, S):
    u = S[LRU_HEAD]
    while u >= 0:
        if not I[PINNED, u]:
            return u
        u = I[LRU_NEXT, u]
    return -1


@jit
def _touch(I, S, u, step):
    S[TICKS] += 1
    S[MUT] += 1
    I[TICK, u] = S[TICKS]
    I[LAST_STEP, u] = step
    if step > S[POL_STEP]:
        S[POL_STEP] = step
    if S[NDIRTY] < I.shape[1]:  # its prior changed (age, gap); a full stack: recompute every prior
        I[DIRTY, S[NDIRTY]] = u
        S[NDIRTY] += 1
    else:
        S[PRIOR_END] = NEVER


@jit
def policy_reset(I, F, S, start):
    """Forget everything; `start` is the start placement, most valuable first."""
    I[LRU_PREV, :] = NOT_LISTED
    I[LRU_NEXT, :] = -1
    S[LRU_HEAD] = S[LRU_TAIL] = -1
    I[TICK, :] = 0
    I[LAST_STEP, :] = -1
    I[LAST_USE, :] = -1
    I[PREV_GAP, :] = 0
    F[RECENT, :] = 0.0
    I[UROW, :] = I[UCLASS, :] * S[NUM_GAP_CLASSES] * S[NUM_COUNT_CLASSES]  # no use yet: no gap, no count
    m = len(start)
    for i in range(m):
        u = start[m - 1 - i]  # most valuable first in = most recent: the list is built from the back
        _lru_append(I, S, u)
        I[TICK, u] = i
    S[TICKS] = m
    S[POL_STEP] = -1
    S[VERSION] = S[MUT] = 0
    S[VAL_STEP] = S[VAL_VERSION] = S[AHEAD_STEP] = S[AHEAD_VERSION] = S[PRIOR_END] = S[COSTS_STEP] = NEVER
    S[FU_VERSION] = NEVER
    S[NDIRTY] = 0
    S[F_FIRST], S[F_LAST] = 0, -1


@jit
def policy_insert(I, S, u, step):
    if S[POLICY] == POLICY_LRU:
        _lru_append(I, S, u)
    else:
        _touch(I, S, u, step)


@jit
def policy_access(I, F, S, u, step):
    if S[POLICY] == POLICY_LRU:
        _lru_append(I, S, u)
    else:
        record_use(I, F, S, u, step)
        _touch(I, S, u, step)


@jit
def policy_remove(I, S, u):
    if S[POLICY] == POLICY_LRU:
        _lru_unlink(I, S, u)
    else:
        S[MUT] += 1


@jit
def least_recent(I, S, pinned_too):
    """The resident uid with the oldest tick (unpinned only unless `pinned_too`); -1 if none."""
    best, tick = -1, 0
    for i in range(S[NUM_PRESENT]):
        u = I[RES, i]
        if (pinned_too or not I[PINNED, u]) and (best < 0 or I[TICK, u] < tick):
            best, tick = u, I[TICK, u]
    return best

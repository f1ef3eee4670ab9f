"""Where a uid's forecast positions are, and the learned prior of its next use beyond the
forecast (`seqmoe.brain.policies.forecast.ForecastPolicy._tail` and `cache.reuse.ReuseTable`), compiled;
`record_use` keeps each uid's row of the table.

The prior of each uid is cached in F[PRIOR] for one forecast end (PRIOR_END) and recomputed only
for the uids used or loaded since (the DIRTY stack `recency` fills).
"""

from __future__ import annotations

import math

import numba as nb

from seqmoe.brain.policies.reuse import COUNT_EDGES, DECAY
from seqmoe.brain.manager.compiled.layout import (
    DIRTY, E_, FAR, F_FIRST, F_LAST, GEOM, LAST_STEP, LAST_USE, LAYER, L_, NDIRTY, NUM_COUNT_CLASSES, NUM_GAP_CLASSES,
    PREV_GAP, PRIOR, PRIOR_END, RECENT, UCLASS, UROW,
)

jit = nb.njit(cache=True)


@jit
def first_positions(S, l):
    """The two forecast positions of layer `l`'s uids: the first at or after F_FIRST, and one token later."""
    first = S[F_FIRST]
    a = first + (l - first) % S[L_]
    return a, a + S[L_]


@jit
def _log2_bucket(x, n):
    """min(floor(log2(max(x, 1))), n - 1), exactly: frexp's exponent (a loop of shifts mispredicts)."""
    return min(math.frexp(max(x, 1))[1] - 1, n - 1)


@jit
def forecast_end(S, cur):
    """The last forecast position, or `cur` when the forecast ends before it."""
    if S[F_LAST] >= S[F_FIRST] and S[F_LAST] > cur:
        return S[F_LAST]
    return cur


@jit
def next_after(S, end, l):
    """The first position of layer `l` after position `end`."""
    return end + 1 + (l - (end + 1)) % S[L_]


@jit
def record_use(I, F, S, u, step):
    """u is used at `step`: its gap, recent count and reuse-table row (`ReuseTable.rows`), as the
    reference's `access` updates them."""
    last = I[LAST_USE, u]
    gap = (step - last) // S[L_] if last >= 0 else 0
    I[PREV_GAP, u] = gap
    F[RECENT, u] = (F[RECENT, u] + 1.0) * DECAY[min(gap, len(DECAY) - 1)] if last >= 0 else 0.0
    I[LAST_USE, u] = step
    G, D = S[NUM_GAP_CLASSES], S[NUM_COUNT_CLASSES]
    cls = I[UCLASS, u] * G
    if G > 1 and gap > 0:
        cls += min(1 + _log2_bucket(gap, G), G - 1)
    cls *= D
    if D > 1:
        recent = F[RECENT, u]
        for edge in COUNT_EDGES:  # searchsorted: the edges below the count
            if edge < recent:
                cls += 1
    I[UROW, u] = cls


@jit
def _prior(I, F, S, TAB, u, nxt):
    """The learned prior of u's next use beyond the forecast, `nxt` being u's first position after it."""
    if TAB.shape[0] == 0:
        return F[GEOM, u] * F[FAR, u]
    age = (nxt - I[LAST_STEP, u]) // S[L_]
    return TAB[I[UROW, u], _log2_bucket(age, TAB.shape[1])] * F[FAR, u]


@jit
def priors(I, F, S, TAB, end):
    """F[PRIOR]: every uid's prior for a forecast ending at `end`, recomputed only where it changed
    (another end, or a use or load since: its age and gap moved)."""
    E, L = S[E_], S[L_]
    if S[PRIOR_END] != end and TAB.shape[0] == 0:
        F[PRIOR] = F[GEOM] * F[FAR]
        S[PRIOR_END] = end
    elif S[PRIOR_END] != end:  # `_prior` of every uid, inline (a call per uid costs here)
        A = TAB.shape[1]
        prior, last, row, far = F[PRIOR], I[LAST_STEP], I[UROW], F[FAR]
        for l in range(L):
            nxt = next_after(S, end, l)
            for u in range(l * E, (l + 1) * E):
                prior[u] = TAB[row[u], _log2_bucket((nxt - last[u]) // L, A)] * far[u]
        S[PRIOR_END] = end
    else:
        for i in range(S[NDIRTY]):
            u = I[DIRTY, i]
            F[PRIOR, u] = _prior(I, F, S, TAB, u, next_after(S, end, I[LAYER, u]))
    S[NDIRTY] = 0
    return F[PRIOR]

"""Where a uid's forecast positions are, and the learned prior of its next use beyond the
forecast (`seqmoe.cache.forecast.ForecastPolicy._tail` and `cache.reuse.ReuseTable`), compiled.

The prior of each uid is cached in F[PRIOR] for one forecast end (PRIOR_END) and recomputed only
for the uids used or loaded since (the DIRTY stack `recency` fills).
"""

from __future__ import annotations

import math

import numba as nb

from seqmoe.manager.compiled.layout import (
    DIRTY, E_, F_FIRST, F_LAST, GEOM, LAST_STEP, LAYER, L_, NDIRTY, NUM_GAP_CLASSES, PREV_GAP, PRIOR, PRIOR_END,
    UCLASS,
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
def _prior(I, F, S, TAB, u, nxt):
    """The learned prior of u's next use beyond the forecast, `nxt` being u's first position after it."""
    if TAB.shape[0] == 0:
        return F[GEOM, u]
    age = (nxt - I[LAST_STEP, u]) // S[L_]
    G = S[NUM_GAP_CLASSES]
    cls = I[UCLASS, u] * G
    if G > 1:
        gap = I[PREV_GAP, u]
        if gap > 0:
            cls += min(1 + _log2_bucket(gap, G), G - 1)
    return TAB[cls, _log2_bucket(age, TAB.shape[1])]


@jit
def priors(I, F, S, TAB, end):
    """F[PRIOR]: every uid's prior for a forecast ending at `end`, recomputed only where it changed
    (another end, or a use or load since: its age and gap moved)."""
    E, L = S[E_], S[L_]
    if S[PRIOR_END] != end and TAB.shape[0] == 0:
        F[PRIOR] = F[GEOM]
        S[PRIOR_END] = end
    elif S[PRIOR_END] != end:  # `_prior` of every uid, inline (a call per uid costs here)
        G, A = S[NUM_GAP_CLASSES], TAB.shape[1]
        prior, last, ucls, prev = F[PRIOR], I[LAST_STEP], I[UCLASS], I[PREV_GAP]
        for l in range(L):
            nxt = next_after(S, end, l)
            for u in range(l * E, (l + 1) * E):
                cls = ucls[u] * G
                gap = prev[u]
                if G > 1 and gap > 0:
                    cls += min(1 + _log2_bucket(gap, G), G - 1)
                prior[u] = TAB[cls, _log2_bucket((nxt - last[u]) // L, A)]
        S[PRIOR_END] = end
    else:
        for i in range(S[NDIRTY]):
            u = I[DIRTY, i]
            F[PRIOR, u] = _prior(I, F, S, TAB, u, next_after(S, end, I[LAYER, u]))
    S[NDIRTY] = 0
    return F[PRIOR]

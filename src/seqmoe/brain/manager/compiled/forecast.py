"""Probabilistic Belady (`seqmoe.brain.policies.forecast.ForecastPolicy`) compiled over the arrays of
`layout`, for forecasts of at most two positions per uid.

It follows the reference's arithmetic operation by operation (entries of probability >= floor,
P(no use so far) as running products of (1 - p) along a uid's entries, discounts from the same
table, keep values cached per (position, forecast) and not per recency change), so it computes
the very same numbers and makes the very same decisions.

A forecast covers positions F_FIRST..F_LAST (at most 2 L of them): uid u of layer l has its first
position a(u), the first at or after F_FIRST of layer l, with probability P_A[u], and a(u) + L
with P_B[u], as `load_forecast` writes them: 0 below the floor (no entry), clipped at 1.

Per (position, forecast) one pass (`refresh`) computes the keep values, and per (position,
forecast, state) one more (`candidates`) the scheduler's candidates; the passes over residents
walk the RES list (`ops.present`), not every uid. The reference computes keep values lazily at
their first use; computing them earlier is the same as long as no use or load happens in between,
which holds for every caller here: the scheduler's calls all come before its first issue, and the
demand victims' after the layer's hits.
Whether a resident is likely used before a position is worked out where it is asked
(`victim_at`), only for the layers that come before that position.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from seqmoe.brain.manager.compiled.layout import (
    AHEAD_STEP, AHEAD_VERSION, CANDS, CANDS_MUT, CANDS_USE, CHEAP, COSTS, COSTS_MUT, COSTS_N, COSTS_N_ASKED,
    COSTS_STEP, COSTS_VERSION, E_, FIRST_USE, FU_STEP, FU_VERSION, F_FIRST, F_LAST, LAYER, L_, MAX_HARM, MIN_PROB,
    MUT, NCANDS, NCOSTS, NUM_PRESENT, PINNED, POLICY, POLICY_FORECAST, POLICY_FORECAST_LRU_VICTIMS, POL_STEP,
    PRESENT, P_A, P_B, RES, TICK, UNUSED, VALUES, VAL_STEP, VAL_VERSION, VERSION, VICTIM_PREFIX,
)
from seqmoe.brain.manager.compiled.prior import first_positions, forecast_end, next_after, priors
from seqmoe.brain.manager.compiled.recency import least_recent

jit = nb.njit(cache=True)


@jit
def forecast_update(S, new_forecast, step):
    """A forecast arrived at position `step` (its arrays already written), or none (keep the last one)."""
    if new_forecast:
        S[VERSION] += 1
    if step > S[POL_STEP]:
        S[POL_STEP] = step


@jit
def load_forecast(I, F, S, steps, probs, floor):
    """Write a forecast (steps [H] increasing, probs [H, E]) into P_A / P_B as the reference's sparse
    entries hold it (`floor` in the dtype of `probs`, as numpy compares them); False when the steps
    are not contiguous or span more than 2 L positions (a forecast this policy cannot hold)."""
    H = steps.shape[0]
    L, E = S[L_], probs.shape[1]
    if H == 0:
        F[P_A, :] = 0.0
        F[P_B, :] = 0.0
        S[F_FIRST], S[F_LAST] = 0, -1
        return True
    first = steps[0]
    if H > 2 * L or steps[H - 1] - first != H - 1:
        return False
    S[F_FIRST], S[F_LAST] = first, steps[H - 1]
    for l in range(L):
        ha = (l - first) % L  # the forecast rows of layer l: ha and ha + L
        for j, row in ((0, P_A), (1, P_B)):
            h = ha + j * L
            for e in range(E):
                p = probs[h, e] if h < H else probs.dtype.type(0.0)
                F[row, l * E + e] = min(np.float64(p), 1.0) if p >= floor else 0.0
    return True


@jit
def cheapest_resident(I, S, values, skip):
    """The resident uid with the lowest value, ties by least recent use, leaving out uids with `skip`
    set; -1 if none."""
    best, v, tick = -1, np.inf, 0
    for i in range(S[NUM_PRESENT]):
        u = I[RES, i]
        if skip[u]:
            continue
        x = values[u]
        if x == np.inf:
            continue
        if best < 0 or x < v or (x == v and I[TICK, u] < tick):
            best, v, tick = u, x, I[TICK, u]
    return best


@jit
def _entries(F, u, in_a, in_b):
    """u's two forecast probabilities, 0 for a position outside the forecast or the entries ahead."""
    return F[P_A, u] * in_a, F[P_B, u] * in_b


@jit
def refresh(I, F, S, G, TAB, DISC):
    """Bring the keep values F[VALUES] (F[UNUSED]: P(no forecast use)) up to date for the policy's
    (position, forecast), in one pass over the uids.

    An entry outside the forecast, or at or before the current position, counts as p = 0: adding 0
    and multiplying by 1 leave the running sums exactly as skipping it would, without a branch."""
    cur, version = S[POL_STEP], S[VERSION]
    if S[VAL_STEP] == cur and S[VAL_VERSION] == version:
        return
    L, E, last = S[L_], S[E_], S[F_LAST]
    end = forecast_end(S, cur)
    prior = priors(I, F, S, TAB, end)
    values, unused, PA, PB = F[VALUES], F[UNUSED], F[P_A], F[P_B]
    for l in range(L):
        a, b = first_positions(S, l)
        in_a, in_b = 1.0 if cur < a <= last else 0.0, 1.0 if cur < b <= last else 0.0
        da, db = DISC[0, max(a - cur, 0)], DISC[0, max(b - cur, 0)]
        dt = DISC[0, next_after(S, end, l) - cur]
        for u in range(l * E, (l + 1) * E):
            pa, pb = PA[u] * in_a, PB[u] * in_b  # `_entries`
            v = pa * 1.0 * da  # P(no use at the entries before) is 1 at the first
            stay_a = 1.0 - pa
            v += pb * stay_a * db
            stay = stay_a * (1.0 - pb)
            unused[u] = stay
            values[u] = v + stay * (dt * prior[u])
    S[VAL_STEP], S[VAL_VERSION] = cur, version


@jit
def _insert(I, values, u, m, k, out):
    """Insert u into out[:m], kept lowest first in (value, tick) and at most k long; the new length."""
    x, t = values[u], I[TICK, u]
    if m == k:
        w = out[m - 1]
        if x > values[w] or (x == values[w] and t > I[TICK, w]):
            return m
    else:
        m += 1
    j = m - 1
    while j > 0:
        w = out[j - 1]
        if values[w] < x or (values[w] == x and I[TICK, w] < t):
            break
        out[j] = w
        j -= 1
    out[j] = u
    return m


@jit
def keep_values(I, F, S, G, TAB, DISC):
    """F[VALUES]: the keep values at the policy's position (see `refresh`)."""
    refresh(I, F, S, G, TAB, DISC)
    return F[VALUES]


@jit
def first_uses(I, F, S, G):
    """I[FIRST_USE], made current for the policy's (position, forecast). Within one forecast a layer's
    first uses change only when the position passes one of its two positions: only the layers
    passed since the last call are redone."""
    cur, version, L, E = S[POL_STEP], S[VERSION], S[L_], S[E_]
    since = S[FU_STEP]
    if S[FU_VERSION] != version or cur < since or cur - since >= L:
        since = cur - L  # every layer
    if since == cur:
        return I[FIRST_USE]
    last, min_prob = S[F_LAST], G[MIN_PROB]
    PA, PB, first_use = F[P_A], F[P_B], I[FIRST_USE]
    for p in range(since + 1, cur + 1):
        l = p % L
        a, b = first_positions(S, l)
        in_a, in_b = 1.0 if cur < a <= last else 0.0, 1.0 if cur < b <= last else 0.0
        for u in range(l * E, (l + 1) * E):
            first_use[u] = a if PA[u] * in_a >= min_prob else (b if PB[u] * in_b >= min_prob else -1)
    S[FU_STEP], S[FU_VERSION] = cur, version
    return first_use


@jit
def candidates(I, F, S, G, TAB, DISC):
    """The CANDS list: absent uids forecast with p >= min_prob at a position ahead (I[FIRST_USE]:
    the first such position), increasing, and G[CANDS_USE] the highest P(use within the forecast)
    among them; its length. Cached per (position, forecast, state)."""
    cur, version, mut = S[POL_STEP], S[VERSION], S[MUT]
    if S[AHEAD_STEP] == cur and S[AHEAD_VERSION] == version and S[CANDS_MUT] == mut:
        return S[NCANDS]
    refresh(I, F, S, G, TAB, DISC)
    first_uses(I, F, S, G)
    unused, first_use, present, cands = F[UNUSED], I[FIRST_USE], I[PRESENT], I[CANDS]
    na, top_use = 0, 0.0
    for u in range(I.shape[1]):
        cands[na] = u
        cand = (first_use[u] >= 0) & (present[u] == 0)  # no branch: presence is a coin toss per uid
        na += cand
        top_use = max(top_use, cand * (1.0 - unused[u]))
    S[NCANDS], G[CANDS_USE] = na, top_use
    S[AHEAD_STEP], S[AHEAD_VERSION], S[CANDS_MUT] = cur, version, mut
    return na


@jit
def cheapest(I, F, S, G, TAB, DISC, n):
    """The `n` (<= COSTS_N) cheapest residents, pinned or not, in (keep value, tick) order: uids in
    I[CHEAP], values in F[COSTS]; how many. Cached per (position, forecast, state), for the
    largest n asked under that key."""
    values = keep_values(I, F, S, G, TAB, DISC)
    n = min(n, COSTS_N)
    if not (S[COSTS_STEP] == S[POL_STEP] and S[COSTS_VERSION] == S[VERSION] and S[COSTS_MUT] == S[MUT]
            and S[COSTS_N_ASKED] >= n):
        S[NCOSTS] = _lowest_resident(I, S, values, n, F[COSTS], I[CHEAP])
        S[COSTS_STEP], S[COSTS_VERSION], S[COSTS_MUT], S[COSTS_N_ASKED] = S[POL_STEP], S[VERSION], S[MUT], n
    return min(n, S[NCOSTS])


@jit
def _lowest_resident(I, S, values, k, out_v, out_u):
    """The k residents lowest in (value, tick), in that order: values into out_v, uids into out_u;
    how many."""
    m = min(k, S[NUM_PRESENT])
    if m == 0:
        return 0
    out_v[:m] = np.inf
    out_u[:m] = -1  # a free place: after every resident, even one of value inf
    tick = I[TICK]
    for i in range(S[NUM_PRESENT]):
        u = I[RES, i]
        x = values[u]
        w = out_u[m - 1]
        if x > out_v[m - 1] or (x == out_v[m - 1] and w >= 0 and tick[u] > tick[w]):
            continue
        j = m - 1
        while j > 0:
            w = out_u[j - 1]
            if out_v[j - 1] < x or (out_v[j - 1] == x and w >= 0 and tick[w] < tick[u]):
                break
            out_v[j], out_u[j] = out_v[j - 1], w
            j -= 1
        out_v[j], out_u[j] = x, u
    return m


@jit
def _busy(I, F, S, u, step, in_a, in_b, a, b, bound):
    """Whether resident u is likely used before `step`: P(no use so far) < bound at an entry before it
    (it only falls along u's entries)."""
    pa, pb = _entries(F, u, in_a, in_b)
    stay_a = 1.0 - pa
    return (stay_a < bound and a < step) or (stay_a * (1.0 - pb) < bound and b < step)


@jit
def victim_at(I, F, S, G, TAB, DISC, step):
    """(victim, wait) of `ForecastPolicy.victim_at` (with the scheduler's max_harm): whom a copy
    needed at `step` should displace now, and whether it should wait because a resident likely used
    before `step` may be worth less then.

    Only uids with a forecast position before `step` can be busy (likely used before it): those of
    the layers at positions cur + 1 .. step - 1, scanned layer by layer."""
    if S[POLICY] == POLICY_FORECAST_LRU_VICTIMS:
        return least_recent(I, S, True), False
    values = keep_values(I, F, S, G, TAB, DISC)
    cur, last, L, E = S[POL_STEP], S[F_LAST], S[L_], S[E_]
    bound = 1.0 - G[MAX_HARM]
    # The victim: the cheapest resident not busy, most often among the few cheapest.
    victim, best_v, best_t = -1, np.inf, 0
    m = cheapest(I, F, S, G, TAB, DISC, VICTIM_PREFIX)
    for i in range(m):
        u = I[CHEAP, i]
        a, b = first_positions(S, I[LAYER, u])
        in_a, in_b = 1.0 if cur < a <= last else 0.0, 1.0 if cur < b <= last else 0.0
        if not _busy(I, F, S, u, step, in_a, in_b, a, b, bound):
            victim = u
            break
    # Else all of them: a uid is checked only when it would improve on the best.
    for i in range(S[NUM_PRESENT] if victim < 0 and m < S[NUM_PRESENT] else 0):
        u = I[RES, i]
        x = values[u]
        if victim >= 0 and (x > best_v or (x == best_v and I[TICK, u] > best_t)):
            continue
        a, b = first_positions(S, I[LAYER, u])
        in_a, in_b = 1.0 if cur < a <= last else 0.0, 1.0 if cur < b <= last else 0.0
        if not _busy(I, F, S, u, step, in_a, in_b, a, b, bound):
            victim, best_v, best_t = u, x, I[TICK, u]
    # The busy ones' values seen from step - 1 (uses at `step` count: those experts are pinned then).
    end = forecast_end(S, step - 1)
    prior = priors(I, F, S, TAB, end)
    low, any_busy = np.inf, False
    PA, PB = F[P_A], F[P_B]
    for l in range(L):
        a, b = first_positions(S, l)
        if a >= step:  # no position of this layer before `step`: none of its uids is busy
            continue
        in_a, in_b = 1.0 if cur < a <= last else 0.0, 1.0 if cur < b <= last else 0.0
        tail = DISC[0, next_after(S, end, l) - (step - 1)]
        da, db = DISC[0, max(a - (step - 1), 0)], DISC[0, max(b - (step - 1), 0)]
        la, lb = 1.0 if a >= step else 0.0, 1.0 if b >= step else 0.0  # entries from `step` on
        b_before = b < step
        for u in range(l * E, (l + 1) * E):
            # `_busy` inline (a < step here): most uids are not, so that is told before presence
            stay_a = 1.0 - PA[u] * in_a
            if not (stay_a < bound or (b_before and stay_a * (1.0 - PB[u] * in_b) < bound)) or not I[PRESENT, u]:
                continue
            any_busy = True
            if victim < 0:
                break
            pa, pb = _entries(F, u, in_a * la, in_b * lb)
            v = pa * 1.0 * da
            stay_a = 1.0 - pa
            v += pb * stay_a * db
            stay = stay_a * (1.0 - pb)
            low = min(low, v + stay * (tail * prior[u]))
        if any_busy and victim < 0:
            break
    if victim < 0:  # nothing resident, or every resident is likely needed before `step`
        return -1, any_busy
    if not any_busy:
        return victim, False
    return victim, bool(low < values[victim] * DISC[1, step - 1 - cur])


@jit
def demand_victims(I, F, S, G, TAB, DISC, k, out):
    """The next k victims the forecast policy would name for a layer's demand copies, in order, into
    `out`; how many (-1: not the forecast policy). Call it once the policy stands at the layer's
    position: then only the newly loaded (pinned) uids are touched between the copies and the keep
    values stay cached, so each later victim is the next of this order still resident and unpinned."""
    if S[POLICY] != POLICY_FORECAST:
        return -1
    values = keep_values(I, F, S, G, TAB, DISC)
    m = 0
    for i in range(S[NUM_PRESENT]):
        u = I[RES, i]
        if I[PINNED, u]:
            continue
        if m == k:  # most uids are not among the k lowest: tell without a call (calls cost here)
            x, w = values[u], out[k - 1]
            if x > values[w] or (x == values[w] and I[TICK, u] > I[TICK, w]):
                continue
        m = _insert(I, values, u, m, k, out)
    return m

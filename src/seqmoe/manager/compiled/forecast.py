"""Probabilistic Belady (`seqmoe.cache.forecast.ForecastPolicy`) compiled over the arrays of
`layout`, for forecasts of at most two positions per uid.

It follows the reference's arithmetic operation by operation (entries of probability >= floor,
P(no use so far) as running products of (1 - p) along a uid's entries, discounts from the same
table, keep values cached per (position, forecast) and not per recency change), so it computes
the very same numbers and makes the very same decisions.

A forecast covers positions F_FIRST..F_LAST (at most 2 L of them): uid u of layer l has its first
position a(u), the first at or after F_FIRST of layer l, with probability P_A[u], and a(u) + L
with P_B[u], as `load_forecast` writes them: 0 below the floor (no entry), clipped at 1.

Per (position, forecast) one pass computes the keep values and what depends on the entries alone
(each uid's first use of p >= min_prob and first position where it is likely used, and the lists
of both). The reference computes keep values lazily at their first use; computing them earlier is
the same as long as no use or load happens in between, which holds for every caller here: the
scheduler's calls all come before its first issue, and the demand victims' after the layer's hits.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from seqmoe.manager.compiled.layout import (
    AHEAD_STEP, AHEAD_VERSION, CANDS, CHEAP, CHEAP_MUT, CHEAP_N, CHEAP_STEP, CHEAP_VERSION, DIRTY, E_, F_FIRST, F_LAST,
    FIRST_LIKELY, FIRST_USE, GEOM, L_, LAST_STEP, LAYER, LIKELY, MAX_HARM, MIN_PROB, MUT, NCANDS, NCHEAP, NDIRTY, NLIKELY,
    NUM_GAP_CLASSES, NUSES, P_A, P_B, PINNED, POL_STEP, POLICY, POLICY_FORECAST, POLICY_FORECAST_LRU_VICTIMS, PRESENT,
    PREV_GAP, PRIOR, PRIOR_END, TICK, UCLASS, UNUSED, USES, VAL_STEP, VAL_VERSION, VALUES, VERSION,
)
from seqmoe.manager.compiled.recency import least_recent

jit = nb.njit(cache=True)
NEVER_LIKELY = np.iinfo(np.int64).max


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
def cheapest_resident(I, values, skip):
    """The resident uid with the lowest value, ties by least recent use; uids with `skip` set are left out; -1 if none."""
    best, v, tick = -1, np.inf, 0
    for u in range(values.shape[0]):
        if not I[PRESENT, u] or skip[u]:
            continue
        x = values[u]
        if x == np.inf:
            continue
        if best < 0 or x < v or (x == v and I[TICK, u] < tick):
            best, v, tick = u, x, I[TICK, u]
    return best


@jit
def _first_positions(S, l):
    """The two forecast positions of layer `l`'s uids: the first at or after F_FIRST, and one token later."""
    first = S[F_FIRST]
    a = first + (l - first) % S[L_]
    return a, a + S[L_]


@jit
def _log2_bucket(x, n):
    """min(floor(log2(max(x, 1))), n - 1)."""
    b = 0
    x = max(x, 1)
    while x > 1 and b < n - 1:
        x >>= 1
        b += 1
    return b


@jit
def _end(S, cur):
    """The last forecast position, or `cur` when the forecast ends before it."""
    if S[F_LAST] >= S[F_FIRST] and S[F_LAST] > cur:
        return S[F_LAST]
    return cur


@jit
def _next_after(S, end, l):
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
def _priors(I, F, S, TAB, end):
    """F[PRIOR]: every uid's prior for a forecast ending at `end`, recomputed only where it changed
    (another end, or a use or load since: its age and gap moved)."""
    E = S[E_]
    if S[PRIOR_END] != end:
        for l in range(S[L_]):
            nxt = _next_after(S, end, l)
            for u in range(l * E, (l + 1) * E):
                F[PRIOR, u] = _prior(I, F, S, TAB, u, nxt)
        S[PRIOR_END] = end
    else:
        for i in range(S[NDIRTY]):
            u = I[DIRTY, i]
            F[PRIOR, u] = _prior(I, F, S, TAB, u, _next_after(S, end, I[LAYER, u]))
    S[NDIRTY] = 0
    return F[PRIOR]


@jit
def refresh(I, F, S, G, TAB, DISC, need_ahead):
    """Bring the per-(position, forecast) results up to date: the keep values F[VALUES] (F[UNUSED]:
    P(no forecast use)) and, with `need_ahead` (computing the values alongside when they are stale
    too), I[FIRST_USE] (first position ahead of p >= min_prob, -1: none), I[FIRST_LIKELY] (first
    position ahead where P(no use so far) < 1 - max_harm) and the lists USES (uids with a first use,
    increasing) and LIKELY (uids with a first likely position, by it)."""
    cur, version = S[POL_STEP], S[VERSION]
    do_a = need_ahead and not (S[AHEAD_STEP] == cur and S[AHEAD_VERSION] == version)
    do_v = not (S[VAL_STEP] == cur and S[VAL_VERSION] == version)
    if not (do_a or do_v):
        return
    L, E, last = S[L_], S[E_], S[F_LAST]
    end = _end(S, cur)
    prior = _priors(I, F, S, TAB, end) if do_v else F[PRIOR]
    min_prob, bound = G[MIN_PROB], 1.0 - G[MAX_HARM]
    span = max(last - cur, 0) + 1
    lists = do_a and do_v  # the scheduler's call: build its CHEAP and CANDS lists in the same pass
    cheap, nc = I[CHEAP], 0
    nu, na = 0, 0
    count = np.zeros(span + 2, dtype=np.int64)  # uids first likely at each position ahead (bin span + 1: never)
    for l in range(L):
        a, b = _first_positions(S, l)
        # An entry outside the forecast counts as p = 0: adding 0 and multiplying by 1 leave the
        # running sums exactly as skipping it would, and the loop needs no branch per uid.
        in_a, in_b = 1.0 if cur < a <= last else 0.0, 1.0 if cur < b <= last else 0.0
        da, db = DISC[0, max(a - cur, 0)], DISC[0, max(b - cur, 0)]
        dt = DISC[0, _next_after(S, end, l) - cur]
        ka, kb = min(max(a - cur, 0), span), min(max(b - cur, 0), span)
        for u in range(l * E, (l + 1) * E):
            pa, pb = F[P_A, u] * in_a, F[P_B, u] * in_b
            v = pa * 1.0 * da  # value so far (P(no use at the entries before) = 1 at the first)
            stay_a = 1.0 - pa
            v += pb * stay_a * db
            stay = stay_a * (1.0 - pb)
            if do_v:
                F[UNUSED, u] = stay
                F[VALUES, u] = v + stay * (dt * prior[u])
            if do_a:
                fu = a if pa >= min_prob else (b if pb >= min_prob else -1)
                la, lb = stay_a < bound, stay < bound
                I[FIRST_USE, u] = fu
                I[FIRST_LIKELY, u] = a if la else (b if lb else NEVER_LIKELY)
                I[USES, nu] = u
                nu += fu >= 0
                count[ka if la else (kb if lb else span + 1)] += 1
            if lists:
                present = I[PRESENT, u]
                I[CANDS, na] = u
                na += fu >= 0 and not present
                if present:
                    nc = _insert_lowest(I, F[VALUES], u, nc, CHEAP_N, cheap)
    if do_v:
        S[VAL_STEP], S[VAL_VERSION] = cur, version
    if do_a:
        S[NUSES] = nu
        at = np.cumsum(count) - count  # counting sort of the likely ones by position
        for u in range(L * E):
            fl = I[FIRST_LIKELY, u]
            if fl != NEVER_LIKELY:
                I[LIKELY, at[fl - cur]] = u
                at[fl - cur] += 1
        S[NLIKELY] = at[span]  # the end of the last position's bin
        S[AHEAD_STEP], S[AHEAD_VERSION] = cur, version
    if lists:
        S[NCHEAP], S[NCANDS] = nc, na
        S[CHEAP_STEP], S[CHEAP_VERSION], S[CHEAP_MUT] = cur, version, S[MUT]


@jit
def keep_values(I, F, S, G, TAB, DISC):
    """F[VALUES]: the keep values at the policy's position (see `refresh`)."""
    refresh(I, F, S, G, TAB, DISC, False)
    return F[VALUES]


@jit
def first_uses(I, F, S, G, TAB, DISC, uids, steps):
    """Each uid's first position ahead forecast with probability >= min_prob (uids increasing); how many."""
    refresh(I, F, S, G, TAB, DISC, True)
    m = S[NUSES]
    for i in range(m):
        u = I[USES, i]
        uids[i], steps[i] = u, I[FIRST_USE, u]
    return m


@jit
def _cheap(I, F, S, G, TAB, DISC):
    """The CHEAP list (the CHEAP_N, or all, residents lowest in (keep value, tick), in that order)
    and the CANDS list (see `candidates`); cached per (position, forecast, state). `refresh` builds
    both in its pass for the scheduler; this rebuilds them after the state changed."""
    if S[CHEAP_STEP] == S[POL_STEP] and S[CHEAP_VERSION] == S[VERSION] and S[CHEAP_MUT] == S[MUT]:
        return S[NCHEAP]
    refresh(I, F, S, G, TAB, DISC, True)
    values = F[VALUES]
    S[NCHEAP] = lowest(I, values, I[PRESENT], 0, CHEAP_N, I[CHEAP])
    na = 0
    for i in range(S[NUSES]):
        u = I[USES, i]
        I[CANDS, na] = u
        na += not I[PRESENT, u]
    S[NCANDS] = na
    S[CHEAP_STEP], S[CHEAP_VERSION], S[CHEAP_MUT] = S[POL_STEP], S[VERSION], S[MUT]
    return S[NCHEAP]


@jit
def _insert_lowest(I, values, u, m, k, out):
    """Insert u into out[:m], kept lowest-first in (value, tick) and at most k long; the new length."""
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
def lowest(I, values, want, skip_pinned, k, out):
    """The k (or fewer) uids with `want` set (and unpinned if `skip_pinned`) lowest in (value, tick),
    in that order, into `out`; how many."""
    m = 0
    for u in range(values.shape[0]):
        if want[u] and not (skip_pinned and I[PINNED, u]):
            m = _insert_lowest(I, values, u, m, k, out)
    return m


@jit
def candidates(I, F, S, G, TAB, DISC):
    """The CANDS list: absent uids forecast with p >= min_prob ahead, increasing; how many (cached
    per (position, forecast, state), as CHEAP)."""
    refresh(I, F, S, G, TAB, DISC, True)
    if not (S[CHEAP_STEP] == S[POL_STEP] and S[CHEAP_VERSION] == S[VERSION] and S[CHEAP_MUT] == S[MUT]):
        _cheap(I, F, S, G, TAB, DISC)
    return S[NCANDS]


@jit
def cheapest_values(I, F, S, G, TAB, DISC, n, out):
    """The `n` (<= CHEAP_N) lowest keep values of the residents, pinned or not, ascending into `out`; how many."""
    m = min(n, _cheap(I, F, S, G, TAB, DISC))
    values = F[VALUES]
    for i in range(m):
        out[i] = values[I[CHEAP, i]]
    return m


@jit
def victim_at(I, F, S, G, TAB, DISC, step, busy):
    """(victim, wait) of `ForecastPolicy.victim_at` (with the scheduler's max_harm): whom a copy
    needed at `step` should displace now, and whether it should wait because a resident likely used
    before `step` may be worth less then. `busy` is scratch [L * E], all 0 (and left so)."""
    if S[POLICY] == POLICY_FORECAST_LRU_VICTIMS:
        return least_recent(I, I.shape[1], True), False
    refresh(I, F, S, G, TAB, DISC, True)
    values = F[VALUES]
    nb_ = 0  # busy: resident and likely used before `step` (a prefix of LIKELY)
    for i in range(S[NLIKELY]):
        u = I[LIKELY, i]
        if I[FIRST_LIKELY, u] >= step:
            break
        if I[PRESENT, u]:
            busy[u] = 1
            nb_ += 1
    m = _cheap(I, F, S, G, TAB, DISC)
    victim = -1
    for i in range(m):
        if not busy[I[CHEAP, i]]:
            victim = I[CHEAP, i]
            break
    if victim < 0 and m == CHEAP_N:  # every listed one is busy: look further
        victim = cheapest_resident(I, values, busy)
    if victim < 0 or nb_ == 0:  # nothing resident, every resident likely needed before `step`, or none
        for i in range(S[NLIKELY]):
            busy[I[LIKELY, i]] = 0
        return victim, victim < 0 and nb_ > 0
    # The busy ones' values seen from step - 1 (uses at `step` count: those experts are pinned then).
    cur, last, L = S[POL_STEP], S[F_LAST], S[L_]
    end = _end(S, step - 1)
    prior = _priors(I, F, S, TAB, end)
    tail = np.empty(L)  # discount of each layer's first position beyond the forecast, seen from step - 1
    for l in range(L):
        tail[l] = DISC[0, _next_after(S, end, l) - (step - 1)]
    low = np.inf
    for i in range(S[NLIKELY]):
        u = I[LIKELY, i]
        if not busy[u]:
            continue
        busy[u] = 0
        l = I[LAYER, u]
        a, b = _first_positions(S, l)
        v, stay = 0.0, 1.0
        p = F[P_A, u]
        if cur < a <= last and a >= step and p > 0.0:
            v += p * stay * DISC[0, a - (step - 1)]
            stay *= 1.0 - p
        p = F[P_B, u]
        if cur < b <= last and b >= step and p > 0.0:
            v += p * stay * DISC[0, b - (step - 1)]
            stay *= 1.0 - p
        low = min(low, v + stay * (tail[l] * prior[u]))
    return victim, bool(low < values[victim] * DISC[1, step - 1 - cur])


@jit
def demand_victims(I, F, S, G, TAB, DISC, k, out):
    """The next k victims the forecast policy would name for a layer's demand copies, in order, into
    `out`; how many (-1: not the forecast policy). Call it once the policy stands at the layer's
    position: then only the newly loaded (pinned) uids are touched between the copies and the keep
    values stay cached, so each later victim is the next of this order still resident and unpinned."""
    if S[POLICY] != POLICY_FORECAST:
        return -1
    return lowest(I, keep_values(I, F, S, G, TAB, DISC), I[PRESENT], 1, k, out)

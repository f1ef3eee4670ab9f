"""Eviction policies compiled over the arrays of `layout`: LRU, and probabilistic Belady
(`seqmoe.cache.forecast.ForecastPolicy`) on a dense forecast of at most two positions per uid.

The forecast policy follows the reference's arithmetic operation by operation (entries of
probability >= floor, P(no use so far) as running products of (1 - p) along a uid's entries,
discounts from the same table, keep values cached per (position, forecast) and not per recency
change), so it computes the very same numbers and makes the very same decisions.

A forecast covers positions F_FIRST..F_LAST (at most 2 L of them): uid u of layer l has its
first position `a(u)`, the first at or after F_FIRST of layer l, with probability P_A[u], and
`a(u) + L` with P_B[u]. `load_forecast` writes them as the reference's sparse entries hold them:
0 below the floor (no entry), clipped at 1.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from seqmoe.manager.compiled.layout import (
    AHEAD_STEP, AHEAD_VERSION, CHEAP, CHEAP_MUT, CHEAP_N, CHEAP_STEP, CHEAP_VERSION, DIRTY, E_, LIKELY, NCHEAP,
    NLIKELY, NUSES, USES, F_FIRST, F_LAST, FIRST_LIKELY, FIRST_USE, GEOM, L_, LAST_STEP, LAST_USE,
    LAYER, LRU_HEAD, LRU_NEXT, LRU_PREV, LRU_TAIL, MAX_HARM, MIN_PROB, MUT, NDIRTY, NUM_GAP_CLASSES, P_A, P_B, PINNED,
    POL_STEP, POLICY, POLICY_FORECAST, POLICY_FORECAST_LRU_VICTIMS, POLICY_LRU, PRESENT, PREV_GAP, PRIOR, PRIOR_END, TICK, TICKS,
    UCLASS, UNUSED, VAL_STEP, VAL_VERSION, VALUES, VERSION,
)

NEVER = -(1 << 40)  # a cache key no position or forecast has

jit = nb.njit(cache=True)
NOT_LISTED = -2  # LRU_PREV of a uid outside the LRU list


# -- LRU: a doubly linked list, oldest at the head -------------------------------------------------
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
def _lru_victim(I, S):
    u = S[LRU_HEAD]
    while u >= 0:
        if not I[PINNED, u]:
            return u
        u = I[LRU_NEXT, u]
    return -1


# -- shared recency ------------------------------------------------------------------------------------
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
def policy_reset(I, S, start):
    """Forget everything; `start` is the start placement, most valuable first."""
    I[LRU_PREV, :] = NOT_LISTED
    I[LRU_NEXT, :] = -1
    S[LRU_HEAD] = S[LRU_TAIL] = -1
    I[TICK, :] = 0
    I[LAST_STEP, :] = -1
    I[LAST_USE, :] = -1
    I[PREV_GAP, :] = 0
    m = len(start)
    for i in range(m):
        u = start[m - 1 - i]  # most valuable first in = most recent: the list is built from the back
        _lru_append(I, S, u)
        I[TICK, u] = i
    S[TICKS] = m
    S[POL_STEP] = -1
    S[VERSION] = S[MUT] = 0
    S[VAL_STEP] = S[VAL_VERSION] = S[AHEAD_STEP] = S[AHEAD_VERSION] = S[PRIOR_END] = S[CHEAP_STEP] = NEVER
    S[NDIRTY] = 0
    S[F_FIRST], S[F_LAST] = 0, -1


@jit
def policy_insert(I, S, u, step):
    if S[POLICY] == POLICY_LRU:
        _lru_append(I, S, u)
    else:
        _touch(I, S, u, step)


@jit
def policy_access(I, S, u, step):
    if S[POLICY] == POLICY_LRU:
        _lru_append(I, S, u)
    else:
        last = I[LAST_USE, u]
        I[PREV_GAP, u] = (step - last) // S[L_] if last >= 0 else 0
        I[LAST_USE, u] = step
        _touch(I, S, u, step)


@jit
def policy_remove(I, S, u):
    if S[POLICY] == POLICY_LRU:
        _lru_unlink(I, S, u)
    else:
        S[MUT] += 1


@jit
def _least_recent(I, n, pinned_too):
    """The resident uid with the oldest tick (unpinned only unless `pinned_too`); -1 if none."""
    best, tick = -1, 0
    for u in range(n):
        if I[PRESENT, u] and (pinned_too or not I[PINNED, u]) and (best < 0 or I[TICK, u] < tick):
            best, tick = u, I[TICK, u]
    return best


@jit
def policy_victim(I, F, S, G, TAB, DISC):
    """The resident, unpinned uid to evict; -1 when all are pinned."""
    kind = S[POLICY]
    if kind == POLICY_LRU:
        return _lru_victim(I, S)
    if kind == POLICY_FORECAST_LRU_VICTIMS:
        return _least_recent(I, I.shape[1], False)
    values = keep_values(I, F, S, G, TAB, DISC)
    return cheapest_resident(I, values, I[PINNED])


@jit
def demand_victims(I, F, S, G, TAB, DISC, k, out):
    """The next k victims `policy_victim` would name for a layer's demand copies, in order, into
    `out`; how many (-1: this policy has no such shortcut, ask `policy_victim` each time).

    For the forecast policy: the k cheapest unpinned residents by (keep value, tick). Between a
    layer's demand copies only the newly loaded (pinned) uids are touched and the keep values stay
    cached, so each later victim is the next of this order that is still resident and unpinned."""
    if S[POLICY] != POLICY_FORECAST:
        return -1
    values = keep_values(I, F, S, G, TAB, DISC)
    m = 0
    for u in range(I.shape[1]):
        if not I[PRESENT, u] or I[PINNED, u]:
            continue
        x, t = values[u], I[TICK, u]
        if m == k:
            w = out[m - 1]
            if x > values[w] or (x == values[w] and t > I[TICK, w]):
                continue
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


# -- the forecast policy ----------------------------------------------------------------------------
@jit
def forecast_update(S, new_forecast, step):
    """A forecast arrived at position `step` (its arrays already written), or none (keep the last one)."""
    if new_forecast:
        S[VERSION] += 1
    if step > S[POL_STEP]:
        S[POL_STEP] = step


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
def keep_values(I, F, S, G, TAB, DISC):
    """F[VALUES] = keep values at the policy's position (F[UNUSED]: P(no forecast use)); cached per
    (position, forecast), as the reference's: uses and loads in between do not recompute them."""
    cur = S[POL_STEP]
    if S[VAL_STEP] == cur and S[VAL_VERSION] == S[VERSION]:
        return F[VALUES]
    L, E, last = S[L_], S[E_], S[F_LAST]
    end = _end(S, cur)
    prior = _priors(I, F, S, TAB, end)
    for l in range(L):
        a, b = _first_positions(S, l)
        use_a, use_b = cur < a <= last, cur < b <= last
        da, db = DISC[0, max(a - cur, 0)], DISC[0, max(b - cur, 0)]
        dt = DISC[0, _next_after(S, end, l) - cur]
        for u in range(l * E, (l + 1) * E):
            v, stay = 0.0, 1.0  # value so far; P(no use at the entries so far)
            p = F[P_A, u]
            if use_a and p > 0.0:
                v += p * stay * da
                stay *= 1.0 - p
            p = F[P_B, u]
            if use_b and p > 0.0:
                v += p * stay * db
                stay *= 1.0 - p
            F[UNUSED, u] = stay
            F[VALUES, u] = v + stay * (dt * prior[u])
    S[VAL_STEP], S[VAL_VERSION] = cur, S[VERSION]
    return F[VALUES]


@jit
def _ahead(I, F, S, G):
    """I[FIRST_USE] (the first position ahead forecast with p >= min_prob, -1: none) and
    I[FIRST_LIKELY] (the first position ahead at which P(no use so far) < 1 - max_harm, a huge
    number if none) of every uid, and the lists USES (uids with a first use, increasing) and LIKELY
    (uids with a first likely position, by it); cached per (position, forecast): they depend on the
    entries alone."""
    cur = S[POL_STEP]
    if S[AHEAD_STEP] == cur and S[AHEAD_VERSION] == S[VERSION]:
        return
    L, E, last = S[L_], S[E_], S[F_LAST]
    min_prob, bound = G[MIN_PROB], 1.0 - G[MAX_HARM]
    never = np.iinfo(np.int64).max
    nu = 0
    span = max(last - cur, 0) + 1
    count = np.zeros(span + 1, dtype=np.int64)  # uids first likely at each position ahead
    for l in range(L):
        a, b = _first_positions(S, l)
        use_a, use_b = cur < a <= last, cur < b <= last
        for u in range(l * E, (l + 1) * E):
            fu, fl, stay = -1, never, 1.0
            p = F[P_A, u]
            if use_a and p > 0.0:
                if p >= min_prob:
                    fu = a
                stay *= 1.0 - p
                if stay < bound:
                    fl = a
            p = F[P_B, u]
            if use_b and p > 0.0:
                if fu < 0 and p >= min_prob:
                    fu = b
                stay *= 1.0 - p
                if fl == never and stay < bound:
                    fl = b
            I[FIRST_USE, u], I[FIRST_LIKELY, u] = fu, fl
            if fu >= 0:
                I[USES, nu] = u
                nu += 1
            if fl != never:
                count[fl - cur] += 1
    S[NUSES] = nu
    at = np.cumsum(count) - count  # counting sort of the likely ones by position
    n = 0
    for u in range(L * E):
        fl = I[FIRST_LIKELY, u]
        if fl != never:
            I[LIKELY, at[fl - cur]] = u
            at[fl - cur] += 1
            n += 1
    S[NLIKELY] = n
    S[AHEAD_STEP], S[AHEAD_VERSION] = cur, S[VERSION]


@jit
def first_uses(I, F, S, G, uids, steps):
    """Each uid's first position ahead forecast with probability >= min_prob (uids increasing); how many."""
    _ahead(I, F, S, G)
    m = S[NUSES]
    for i in range(m):
        u = I[USES, i]
        uids[i], steps[i] = u, I[FIRST_USE, u]
    return m


@jit
def _cheap(I, F, S, G, TAB, DISC):
    """The CHEAP list: the CHEAP_N (or all) residents lowest in (keep value, tick), in that order;
    cached per (position, forecast, state)."""
    if S[CHEAP_STEP] == S[POL_STEP] and S[CHEAP_VERSION] == S[VERSION] and S[CHEAP_MUT] == S[MUT]:
        return S[NCHEAP]
    values = keep_values(I, F, S, G, TAB, DISC)
    lst = I[CHEAP]
    m = 0
    for u in range(I.shape[1]):
        if not I[PRESENT, u]:
            continue
        x, t = values[u], I[TICK, u]
        if m == CHEAP_N:
            w = lst[m - 1]
            if x > values[w] or (x == values[w] and t > I[TICK, w]):
                continue
        else:
            m += 1
        k = m - 1  # insertion into the sorted prefix
        while k > 0:
            w = lst[k - 1]
            if values[w] < x or (values[w] == x and I[TICK, w] < t):
                break
            lst[k] = w
            k -= 1
        lst[k] = u
    S[NCHEAP] = m
    S[CHEAP_STEP], S[CHEAP_VERSION], S[CHEAP_MUT] = S[POL_STEP], S[VERSION], S[MUT]
    return m


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
        return _least_recent(I, I.shape[1], True), False
    values = keep_values(I, F, S, G, TAB, DISC)
    _ahead(I, F, S, G)
    n = I.shape[1]
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
def load_forecast(I, F, S, steps, probs, floor):
    """Write a forecast (steps [H] increasing, probs [H, E]) into P_A / P_B as the reference's sparse
    entries hold it (`floor` in the dtype of `probs`, as numpy compares them); False when the steps
    are not contiguous or span more than 2 L positions (a forecast this policy cannot hold)."""
    H = steps.shape[0]
    L, E = S[L_], probs.shape[1]
    F[P_A, :] = 0.0
    F[P_B, :] = 0.0
    if H == 0:
        S[F_FIRST], S[F_LAST] = 0, -1
        return True
    first = steps[0]
    if H > 2 * L or steps[H - 1] - first != H - 1:
        return False
    S[F_FIRST], S[F_LAST] = first, steps[H - 1]
    for h in range(H):
        s = first + h
        row = P_A if h < L else P_B
        base = (s % L) * E
        for e in range(E):
            p = probs[h, e]
            if p >= floor:
                F[row, base + e] = min(np.float64(p), 1.0)
    return True

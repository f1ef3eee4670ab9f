"""`seqmoe.brain.schedule.deadline.DeadlinePrefetcher` compiled: job sequencing with deadlines over the
compiled forecast policy, the same candidates, plan, issue order and victims as the reference.

Scratch: JI int64 [2, max_jobs] and JF float64 [2, max_jobs] hold the cached candidates (uid,
deadline step; expected hits, profit) and MI int64 [3, 4 max_tries] the answers of `victim_at`,
both valid while the policy's (position, forecast, state) key holds; WF float64 [1, L * E] is
working space.
"""

from __future__ import annotations


import numba as nb
import numpy as np

import seqmoe.brain.manager.compiled.channel as channel
import seqmoe.brain.manager.compiled.ops as ops
from seqmoe.brain.manager.compiled.forecast import (candidates, cheapest, first_uses, forecast_update, keep_values,
                                               victim_at)
from seqmoe.brain.manager.compiled.layout import (
    CANDS, CANDS_USE, COPY_S, COSTS, FIRST_USE, JOBS_KEY_MUT, JOBS_KEY_STEP, JOBS_KEY_VERSION, LEAD, L_, MARGIN,
    MAX_JOBS, MAX_TRIES, MEMO_MUT, MEMO_STEP, MEMO_VERSION, MUT, NJOBS, NMEMO, NOW, PACE, PF_QUEUED, POL_STEP, STEP,
    TOKEN_S, UNUSED, VALUES, VERSION,
)

jit = nb.njit(cache=True)


@jit
def slots_by_deadline(d, length, start, limit):
    """`schedule.deadline.slots_by_deadline` for one deadline (the very same arithmetic)."""
    n = np.floor((d - start) / length)
    if n != n:  # nan
        n = 0.0
    n = min(max(n, 0.0), float(limit))
    if n > 0 and start + n * length > d:
        n -= 1.0
    if n < limit and start + (n + 1.0) * length <= d:
        n += 1.0
    return int(n)


@jit
def plan_jobs(deadlines, profits, length, start, chosen):
    """`schedule.deadline.plan_jobs`: marks the most profitable feasible set of equal-length jobs in `chosen`."""
    n = profits.shape[0]
    parent = np.arange(n + 1)  # parent chain of slot k leads to the latest free slot <= k; 0: none
    for j in np.argsort(-profits, kind="mergesort"):
        if profits[j] <= 0:
            break
        k = slots_by_deadline(deadlines[j], length, start, n)
        root = k
        while parent[root] != root:
            root = parent[root]
        while parent[k] != root:  # path compression
            nxt = parent[k]
            parent[k] = root
            k = nxt
        if root == 0:
            continue
        chosen[j] = True
        parent[root] = root - 1


@jit
def eta(S, G, step):
    """When the layer at `step` starts its experts, at the measured pace (`PoolView.eta`)."""
    cur = S[STEP]
    L = S[L_]
    tokens_crossed = step // L - cur // L
    return G[NOW] + (step - cur) * G[PACE] + tokens_crossed * G[TOKEN_S]


@jit
def _most_valuable(values, uids, k, scratch):
    """Indices into `uids` of the first k of a stable sort by decreasing values[uids]: the most
    valuable to keep (likely and near) first, ties in uid order."""
    a = len(uids)
    v = scratch[:a]
    for i in range(a):
        v[i] = -values[uids[i]]
    if a <= k:
        return np.argsort(v, kind="mergesort")
    cut = np.partition(v, k - 1)[k - 1]  # the k-th smallest of -value
    chosen = np.empty(k, dtype=np.int64)
    c = 0
    for i in range(a):  # everything better than the cut, then ties at the cut in uid order
        if -values[uids[i]] < cut:
            chosen[c] = i
            c += 1
    for i in range(a):
        if c == k:
            break
        if -values[uids[i]] == cut:
            chosen[c] = i
            c += 1
    key = np.empty(k)
    for j in range(k):
        key[j] = -values[uids[chosen[j]]]
    return chosen[np.argsort(key, kind="mergesort")]


@jit
def _ranked(values, uids, k, eligible):
    """(ranks, order) of the `eligible` uids among all of `uids` in `_most_valuable`'s order (rank
    r: r uids come before), only those with rank < k, by rank. One count per eligible uid: cheaper
    than ordering every uid when few are eligible."""
    n = len(eligible)
    ranks = np.empty(n, dtype=np.int64)
    for j in range(n):
        e = eligible[j]
        v, r = values[e], 0
        for i in range(len(uids)):
            w = uids[i]
            r += (values[w] > v) | ((values[w] == v) & (w < e))
        ranks[j] = r
    order = np.argsort(ranks, kind="mergesort")
    m = 0
    while m < n and ranks[order[m]] < k:
        m += 1
    return ranks, order[:m]


@jit
def _find_jobs(I, F, S, G, TAB, DISC, JI, JF, WF):
    """Candidate copies into JI / JF (see the module doc); how many.

    The i-th most valuable candidate pairs with the i-th cheapest resident. A job's profit value -
    (1 - value) cost exceeds the margin only if its use probability (value) does, whatever its cost
    (>= 0): only those "eligible" candidates can make jobs, and the costs are needed only up to
    the last of them."""
    a = candidates(I, F, S, G, TAB, DISC)  # absent, forecast with p >= min_prob ahead
    margin = G[MARGIN]
    if a == 0 or G[CANDS_USE] <= margin:
        return 0
    uids = I[CANDS, :a]
    values, unused = F[VALUES], F[UNUSED]
    eligible = np.empty(a, dtype=np.int64)
    ne = 0
    for i in range(a):
        eligible[ne] = uids[i]
        ne += 1.0 - unused[uids[i]] > margin
    if ne <= 16:
        ranks, order = _ranked(values, uids, S[MAX_JOBS], eligible[:ne])
        pos, who = ranks[order], eligible[:ne][order]
    else:  # many eligible: order the candidates instead
        top = _most_valuable(values, uids, S[MAX_JOBS], WF[0])
        m = 0
        for i in range(len(top)):
            m += 1.0 - unused[uids[top[i]]] > margin
        pos, who = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64)
        m = 0
        for i in range(len(top)):
            u = uids[top[i]]
            if 1.0 - unused[u] > margin:
                pos[m], who[m] = i, u
                m += 1
    if len(pos) == 0:
        return 0
    c = cheapest(I, F, S, G, TAB, DISC, pos[-1] + 1)  # the cheapest residents pair with them
    cost = F[COSTS]
    k = 0
    for j in range(len(pos)):
        i, u = pos[j], who[j]
        if i >= c:
            break
        value = 1.0 - unused[u]  # expected hits a copy adds
        profit = value - (1.0 - value) * cost[i]
        # Do no harm: the newcomer must be worth more than its victim, else it is the next one evicted.
        if profit > margin and values[u] > cost[i]:
            JI[0, k], JI[1, k] = u, I[FIRST_USE, u]
            JF[0, k], JF[1, k] = value, profit
            k += 1
    return k


@jit
def _jobs(I, F, S, G, TAB, DISC, JI, JF, WF):
    if S[JOBS_KEY_STEP] != S[POL_STEP] or S[JOBS_KEY_VERSION] != S[VERSION] or S[JOBS_KEY_MUT] != S[MUT]:
        S[NJOBS] = _find_jobs(I, F, S, G, TAB, DISC, JI, JF, WF)
        S[JOBS_KEY_STEP], S[JOBS_KEY_VERSION], S[JOBS_KEY_MUT] = S[POL_STEP], S[VERSION], S[MUT]
    return S[NJOBS]


@jit
def _cancel_stale(I, F, S, G, EV, TAB, DISC):
    """Cancel queued prefetches the new forecast no longer expects (p < min_prob at every position ahead)."""
    for u in range(I.shape[1]):
        q = I[PF_QUEUED, u]
        if q < 0:
            continue
        if q <= S[STEP]:
            I[PF_QUEUED, u] = -1  # its layer has routed
        elif first_uses(I, F, S, G)[u] < 0:
            ops.cancel(I, S, EV, u)  # False once the copy has started: then it simply runs
            I[PF_QUEUED, u] = -1


@jit
def plan(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, JI, JF, WF, MI, new_forecast):
    """`DeadlinePrefetcher.plan`: re-plan and issue the head of the plan (`new_forecast`: a forecast
    was just loaded)."""
    forecast_update(S, new_forecast, S[STEP])
    if new_forecast:
        _cancel_stale(I, F, S, G, EV, TAB, DISC)
    now, copy = G[NOW], G[COPY_S]
    start = channel.backlog_end(S, G, now)
    lead = G[LEAD]
    if lead < 0:  # one layer at the measured pace
        lead = (eta(S, G, S[STEP] + 1) - now) / copy
    room = int(np.ceil(lead - max(start - now, 0.0) / copy))
    if room <= 0:
        return
    n = _jobs(I, F, S, G, TAB, DISC, JI, JF, WF)
    if n == 0:
        return
    deadlines = np.empty(n)
    for j in range(n):
        deadlines[j] = eta(S, G, JI[1, j])
    keep = np.zeros(n, dtype=np.bool_)
    for j in range(n):  # late whatever we do: still worth it (it starts before the demand copy would)
        keep[j] = slots_by_deadline(deadlines[j], copy, start, 1) == 0
    plan_jobs(deadlines, JF[1, :n], copy, start, keep)  # the best set that can be on time
    order = np.flatnonzero(keep)
    order = order[np.argsort(deadlines[order], kind="mergesort")]
    # Earliest deadline first: copies arrive in the order of use, each victim chosen as Belady would at that use.
    tries = min(len(order), S[MAX_TRIES])
    for i in range(tries):
        j = order[i]
        step = JI[1, j]
        victim, wait = _victim_at(I, F, S, G, TAB, DISC, MI, step)
        if wait:
            continue
        uid = JI[0, j]
        if victim >= 0:
            values = keep_values(I, F, S, G, TAB, DISC)
            cost = values[victim]
            value = JF[0, j]
            if value - (1.0 - value) * cost <= G[MARGIN] or values[uid] <= cost:
                continue
        if not ops.prefetch(I, F, S, G, DQ, PH, RQI, RQF, EV, TAB, DISC, uid, step, victim):
            continue  # the victim is pinned
        I[PF_QUEUED, uid] = step
        room -= 1
        if room == 0:
            break


@jit
def _victim_at(I, F, S, G, TAB, DISC, MI, step):
    """`victim_at(step)`, memoised while the policy's (position, forecast, state) stays (MI: int64
    [3, M] rows step, victim, wait)."""
    if S[MEMO_STEP] != S[POL_STEP] or S[MEMO_VERSION] != S[VERSION] or S[MEMO_MUT] != S[MUT]:
        S[MEMO_STEP], S[MEMO_VERSION], S[MEMO_MUT], S[NMEMO] = S[POL_STEP], S[VERSION], S[MUT], 0
    for q in range(S[NMEMO]):
        if MI[0, q] == step:
            return MI[1, q], MI[2, q] != 0
    victim, wait = victim_at(I, F, S, G, TAB, DISC, step)
    q = S[NMEMO]
    if q < MI.shape[1]:
        MI[0, q], MI[1, q], MI[2, q] = step, victim, wait
        S[NMEMO] = q + 1
    return victim, wait

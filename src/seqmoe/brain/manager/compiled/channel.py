"""The copy channel of `seqmoe.brain.manager.channel.CopyChannel`, compiled over the arrays of `layout`.

Same rules and the same order of copies: a demand copy goes ahead of queued prefetches but does
not interrupt the running copy; prefetches run earliest deadline first (ties by issue order); the
channel advances lazily. The demand queue and the finished-copies queue are rings, the prefetch
queue a binary heap on (deadline, sequence) that keeps stale entries (promoted or cancelled) until
they surface, as the reference does. An in-place read of u (`read`) is a demand under the key
-1 - u that nobody cancels or promotes: it is always live, counted in READS, not in STARTED; when
it ends is kept in G[READS_END] (the reads of the layer being served, the only ones not done). A
twin read is the same under -1 - L * E - u, lasting G[TWIN_S] (also counted in TWIN_READS).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from seqmoe.brain.manager.compiled.layout import (
    COPY_S, DONE_AT, DQ_HEAD, DQ_LEN, E_, FINISH, FREE_AT, L_, NQUEUED, PH_LEN, QSEQ, READS, READS_END, RQ_HEAD, RQ_LEN,
    SEQ, STARTED, TWIN_QUEUED, TWIN_READS, TWIN_S,
)

jit = nb.njit(cache=True)


@jit
def _heap_less(PH, a, b):
    return PH[0, a] < PH[0, b] or (PH[0, a] == PH[0, b] and PH[1, a] < PH[1, b])


@jit
def _heap_swap(PH, a, b):
    for r in range(3):
        PH[r, a], PH[r, b] = PH[r, b], PH[r, a]


@jit
def _sift_up(PH, i):
    while i > 0:
        parent = (i - 1) // 2
        if not _heap_less(PH, i, parent):
            break
        _heap_swap(PH, i, parent)
        i = parent


@jit
def _sift_down(PH, i, n):
    while True:
        left, best = 2 * i + 1, i
        if left < n and _heap_less(PH, left, best):
            best = left
        if left + 1 < n and _heap_less(PH, left + 1, best):
            best = left + 1
        if best == i:
            return
        _heap_swap(PH, i, best)
        i = best


@jit
def _compact_heap(I, S, PH):
    """Drop stale entries and re-heapify (the pop order of the live ones is unchanged: keys are unique)."""
    n = 0
    for i in range(S[PH_LEN]):
        if I[QSEQ, PH[2, i]] == PH[1, i]:
            for r in range(3):
                PH[r, n] = PH[r, i]
            n += 1
    S[PH_LEN] = n
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(PH, i, n)


@jit
def _heap_push(I, S, PH, deadline, seq, uid):
    if S[PH_LEN] == PH.shape[1]:
        _compact_heap(I, S, PH)
    i = S[PH_LEN]
    PH[0, i], PH[1, i], PH[2, i] = deadline, seq, uid
    S[PH_LEN] = i + 1
    _sift_up(PH, i)


@jit
def _heap_pop(S, PH):
    """(seq, uid) of the smallest entry, removed."""
    seq, uid = PH[1, 0], PH[2, 0]
    n = S[PH_LEN] - 1
    S[PH_LEN] = n
    if n > 0:
        for r in range(3):
            PH[r, 0] = PH[r, n]
        _sift_down(PH, 0, n)
    return seq, uid


@jit
def is_twin(S, key):
    """`key` is a twin read's (below every in-place key)."""
    return key < -S[L_] * S[E_]


@jit
def duration(S, G, key):
    """Seconds the transfer under `key` holds the channel (`CopyChannel.duration`)."""
    return G[TWIN_S] if is_twin(S, key) else G[COPY_S]


@jit
def span(S, G, keys, twins, copies):
    """Seconds of `keys` transfers (`twins` of them twin reads) and `copies` more copies (`CopyChannel._span`)."""
    t = (keys - twins + copies) * G[COPY_S]
    return t + twins * G[TWIN_S] if twins else t


@jit
def start_next(I, F, S, G, DQ, PH, RQI, RQF, at):
    """Start the next live queued copy at time `at` (demand first); False when none is queued."""
    cap = DQ.shape[1]
    while S[DQ_LEN] > 0 or S[PH_LEN] > 0:
        if S[DQ_LEN] > 0:
            h = S[DQ_HEAD]
            seq, uid = DQ[0, h], DQ[1, h]
            S[DQ_HEAD] = (h + 1) % cap
            S[DQ_LEN] -= 1
        else:
            seq, uid = _heap_pop(S, PH)
        if uid >= 0 and I[QSEQ, uid] != seq:  # promoted or cancelled entry
            continue
        S[NQUEUED] -= 1
        G[FREE_AT] = at + duration(S, G, uid)
        if uid >= 0:
            I[QSEQ, uid] = -1
            F[DONE_AT, uid] = G[FREE_AT]
            S[STARTED] += 1
        else:
            G[READS_END] = max(G[READS_END], G[FREE_AT])
            S[READS] += 1
            if is_twin(S, uid):
                S[TWIN_READS] += 1
                S[TWIN_QUEUED] -= 1
        r = (S[RQ_HEAD] + S[RQ_LEN]) % RQI.shape[0]
        RQI[r], RQF[r] = uid, G[FREE_AT]
        S[RQ_LEN] += 1
        return True
    return False


@jit
def advance(I, F, S, G, DQ, PH, RQI, RQF, t, out):
    """Run the channel up to time t; writes the uids whose copies finished by t to `out`, returns how many
    (in-place reads as -1 - uid)."""
    while G[FREE_AT] < t and S[NQUEUED] > 0 and start_next(I, F, S, G, DQ, PH, RQI, RQF, G[FREE_AT]):
        pass
    n = 0
    while S[RQ_LEN] > 0 and RQF[S[RQ_HEAD]] <= t:
        uid = RQI[S[RQ_HEAD]]
        S[RQ_HEAD] = (S[RQ_HEAD] + 1) % RQI.shape[0]
        S[RQ_LEN] -= 1
        if uid >= 0:
            F[DONE_AT, uid] = np.nan
        out[n] = uid
        n += 1
    return n


@jit
def _kick(I, F, S, G, DQ, PH, RQI, RQF, now):
    if G[FREE_AT] <= now:
        start_next(I, F, S, G, DQ, PH, RQI, RQF, now)


@jit
def demand(I, F, S, G, DQ, PH, RQI, RQF, uid, now):
    """Queue a demand copy at `now` (ahead of prefetches, behind earlier demands); also a promotion."""
    S[SEQ] += 1
    if I[QSEQ, uid] < 0:
        S[NQUEUED] += 1
    I[QSEQ, uid] = S[SEQ]
    cap = DQ.shape[1]
    r = (S[DQ_HEAD] + S[DQ_LEN]) % cap
    DQ[0, r], DQ[1, r] = S[SEQ], uid
    S[DQ_LEN] += 1
    _kick(I, F, S, G, DQ, PH, RQI, RQF, now)


@jit
def read(I, F, S, G, DQ, PH, RQI, RQF, uid, now, twin):
    """Queue an in-place read of `uid` (of its twin when `twin`) at `now`, as a demand copy (ahead of
    prefetches, behind earlier demands)."""
    S[SEQ] += 1
    S[NQUEUED] += 1
    cap = DQ.shape[1]
    r = (S[DQ_HEAD] + S[DQ_LEN]) % cap
    DQ[0, r], DQ[1, r] = S[SEQ], -1 - uid
    if twin:
        DQ[1, r] -= S[L_] * S[E_]
        S[TWIN_QUEUED] += 1
    S[DQ_LEN] += 1
    _kick(I, F, S, G, DQ, PH, RQI, RQF, now)


@jit
def prefetch(I, F, S, G, DQ, PH, RQI, RQF, uid, deadline_step, now):
    """Queue a prefetch at `now`; prefetches start earliest `deadline_step` first."""
    S[SEQ] += 1
    if I[QSEQ, uid] < 0:
        S[NQUEUED] += 1
    I[QSEQ, uid] = S[SEQ]
    _heap_push(I, S, PH, deadline_step, S[SEQ], uid)
    _kick(I, F, S, G, DQ, PH, RQI, RQF, now)


@jit
def cancel(I, S, uid):
    """Drop a queued (not started) copy; False if it already started or was never queued."""
    if I[QSEQ, uid] >= 0:
        I[QSEQ, uid] = -1
        S[NQUEUED] -= 1
        return True
    return False


@jit
def cancel_latest_prefetch(I, S, PH, keep):
    """Cancel the live queued prefetch with the latest (deadline, seq) whose uid is not in `keep`; its uid or -1."""
    best = -1
    for i in range(S[PH_LEN]):
        uid = PH[2, i]
        if I[QSEQ, uid] != PH[1, i]:
            continue
        skip = False
        for k in keep:
            if k == uid:
                skip = True
        if skip:
            continue
        if best < 0 or PH[0, i] > PH[0, best] or (PH[0, i] == PH[0, best] and PH[1, i] > PH[1, best]):
            best = i
    if best < 0:
        return -1
    uid = PH[2, best]
    I[QSEQ, uid] = -1
    S[NQUEUED] -= 1
    return uid


@jit
def running_until(S, RQF):
    """When the copy in progress ends, or -inf when none runs."""
    if S[RQ_LEN] == 0:
        return -np.inf
    return RQF[(S[RQ_HEAD] + S[RQ_LEN] - 1) % RQF.shape[0]]


@jit
def demand_finish_times(I, F, S, G, DQ):
    """F[FINISH, uid] = completion time of each live queued demand copy, in queue order behind the running
    copy (of the queued in-place reads: the latest into G[READS_END])."""
    t = G[FREE_AT]
    cap = DQ.shape[1]
    for j in range(S[DQ_LEN]):
        r = (S[DQ_HEAD] + j) % cap
        seq, uid = DQ[0, r], DQ[1, r]
        if uid < 0:
            t += duration(S, G, uid)
            G[READS_END] = max(G[READS_END], t)
        elif I[QSEQ, uid] == seq:
            t += G[COPY_S]
            F[FINISH, uid] = t


@jit
def next_demand_end(I, S, G, DQ, now, twin=False):
    """When a demand copy (a twin read when `twin`) queued now would finish: behind the running copy
    and the queued demands."""
    cap, queued, twins = DQ.shape[1], 0, 0
    for j in range(S[DQ_LEN]):
        r = (S[DQ_HEAD] + j) % cap
        uid = DQ[1, r]
        if uid < 0 or I[QSEQ, uid] == DQ[0, r]:
            queued += 1
            twins += is_twin(S, uid)
    if twin:
        return max(G[FREE_AT], now) + span(S, G, queued, twins, 0) + G[TWIN_S]
    return max(G[FREE_AT], now) + span(S, G, queued, twins, 1)


@jit
def backlog_end(S, G, now):
    """When the channel would be idle if nothing more were issued."""
    return max(G[FREE_AT], now) + span(S, G, S[NQUEUED], S[TWIN_QUEUED], 0)

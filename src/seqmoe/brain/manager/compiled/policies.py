"""The eviction policies of the compiled manager, by kind: LRU (`recency`), probabilistic Belady
(`forecast`) and the ablation that values by forecast but evicts least recently used."""

from __future__ import annotations

import numba as nb

from seqmoe.brain.manager.compiled.forecast import cheapest_resident, keep_values
from seqmoe.brain.manager.compiled.layout import PINNED, POLICY, POLICY_FORECAST_LRU_VICTIMS, POLICY_LRU
from seqmoe.brain.manager.compiled.recency import least_recent, lru_victim

jit = nb.njit(cache=True)


@jit
def policy_victim(I, F, S, G, TAB, DISC):
    """The resident, unpinned uid to evict; -1 when all are pinned."""
    kind = S[POLICY]
    if kind == POLICY_LRU:
        return lru_victim(I, S)
    if kind == POLICY_FORECAST_LRU_VICTIMS:
        return least_recent(I, S, False)
    return cheapest_resident(I, S, keep_values(I, F, S, G, TAB, DISC), I[PINNED])

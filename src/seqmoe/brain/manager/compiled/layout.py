"""Where the compiled manager keeps its state: a few preallocated arrays and named rows of them.

Numba compiles these names as constants. Per-uid fields are rows of `I` (int64 [NI, L * E]) and
`F` (float64 [NF, L * E]); scalars live in `S` (int64 [NS]) and `G` (float64 [NG]). The copy
channel's queues are rings (DQ, RQI / RQF) and a binary heap (PH) over arrays of their own (`channel`);
an in-place read of u sits in them as uid -1 - u, a twin read as -1 - L * E - u. Events for the
observer (the runtime's data plane) go to `EV` (int64 [cap, 3]: kind, uid, deadline step).
"""

from __future__ import annotations

from seqmoe.brain.manager.miss_paths import CPU_COPY, MISS_RULES, TWIN

# -- per-uid int fields (rows of I) ---------------------------------------------------------------
PRESENT = 0  # resident, or its copy issued
UNUSED_PF = 1  # prefetched and not used yet
PENDING = 2  # copy issued and not finished
PINNED = 3  # pending, or needed by the current layer
QSEQ = 4  # channel: sequence number of the live queue entry, -1 when not queued
LRU_PREV = 5  # LRU list: previous (older) uid, -1 at the head
LRU_NEXT = 6  # LRU list: next (newer) uid, -1 at the tail
TICK = 7  # recency tick of the last insert or use
LAST_STEP = 8  # position of the last use or insert (-1: none)
LAST_USE = 9  # position of the last use (-1: none)
PREV_GAP = 10  # tokens between the last two uses (0: one use or none)
PF_QUEUED = 11  # deadline scheduler: position a prefetch was issued for (-1: none)
ADDED = 12  # scratch: pinned at the start of the current layer
LAYER = 13  # static: layer of the uid
UCLASS = 14  # static: frequency class of the uid in the reuse table
FIRST_USE = 15  # forecast policy: first position ahead forecast with p >= min_prob (-1: none)
DIRTY = 16  # forecast policy: uids whose prior changed since it was computed (a stack, NDIRTY long)
CANDS = 17  # forecast policy: absent uids with a FIRST_USE, increasing (NCANDS of them)
RES = 18  # the PRESENT uids in no order (NUM_PRESENT of them): passes over residents skip the absent
RES_AT = 19  # where the uid stands in RES, -1 when absent
CHEAP = 20  # forecast policy: the uids of COSTS, in (keep value, tick) order
UROW = 21  # forecast policy: the uid's row of the reuse table, set at each use (`ReuseTable.rows`)
NI = 22

# -- per-uid float fields (rows of F) -------------------------------------------------------------
DONE_AT = 0  # channel: completion time of a started, unfinished copy
P_A = 1  # forecast: probability of use at the uid's first forecast position (0: no entry)
P_B = 2  # forecast: at its second forecast position (one token later; 0: no entry)
VALUES = 3  # forecast policy: cached keep values
UNUSED = 4  # forecast policy: cached P(no forecast use)
GEOM = 5  # static: the prior beyond the horizon without a reuse table
FINISH = 6  # scratch: demand-copy finish times
PRIOR = 7  # forecast policy: cached prior beyond the horizon (for the forecast end PRIOR_END)
COSTS = 8  # forecast policy: the COSTS_N lowest keep values of the residents, ascending
RECENT = 9  # forecast policy: recent use count at the last use (`cache.reuse.decayed_count`)
FAR = 10  # forecast policy: the prior's factor from the forecaster's long-range head (1: none)
NF = 11

# -- int scalars (S) ------------------------------------------------------------------------------
L_, E_, K_, CAP, NUM_PRESENT, STEP = 0, 1, 2, 3, 4, 5
SEQ, STARTED, NQUEUED = 6, 7, 8  # channel
DQ_HEAD, DQ_LEN, PH_LEN, RQ_HEAD, RQ_LEN = 9, 10, 11, 12, 13  # channel queues
READY, LATE, MISSES, PREFETCHES, WASTED, CANCELLED = 14, 15, 16, 17, 18, 19  # counts
TICKS, LRU_HEAD, LRU_TAIL = 20, 21, 22  # recency
POL_STEP, VERSION, MUT, VAL_STEP, VAL_VERSION = 23, 24, 25, 26, 27  # forecast policy (VAL_*: cache key)
F_FIRST, F_LAST = 28, 29  # forecast: first and last position covered (F_LAST < F_FIRST: none)
NEV = 30  # events recorded
POLICY, PREFETCHER, NUM_GAP_CLASSES = 31, 32, 33  # kinds (below)
JOBS_KEY_STEP, JOBS_KEY_VERSION, JOBS_KEY_MUT, NJOBS = 34, 35, 36, 37  # deadline scheduler's cached candidates
MAX_JOBS, MAX_TRIES = 38, 39  # deadline scheduler's limits
PRIOR_END, NDIRTY, AHEAD_STEP, AHEAD_VERSION = 40, 41, 42, 43  # forecast policy caches
CANDS_MUT, COSTS_STEP, COSTS_VERSION, COSTS_MUT = 44, 45, 46, 47  # COSTS_*: the COSTS' key
MEMO_STEP, MEMO_VERSION, MEMO_MUT, NMEMO = 48, 49, 50, 51  # deadline scheduler's victim_at answers
NCANDS, NCOSTS, COSTS_N_ASKED = 52, 53, 54  # COSTS_N_ASKED: how many lowest the COSTS hold at most
FU_STEP, FU_VERSION = 55, 56  # the (position, forecast) FIRST_USE holds for
NUM_COUNT_CLASSES = 57  # the reuse table's recent-count classes
MISS, READS, IN_PLACE, HOST, HOST_SERVED = 58, 59, 60, 61, 62  # miss path (kinds below); counts; this layer's on the host
TWIN_READS, TWIN_QUEUED, TWINS = 63, 64, 65  # twin reads started; queued; misses served by twins
NS = 66

COSTS_N = 64
"""Lowest resident keep values kept for the scheduler (it pairs at most max_jobs candidates with them)."""
VICTIM_PREFIX = 8
"""Cheapest residents `victim_at` looks through before it scans them all."""

# -- float scalars (G) ----------------------------------------------------------------------------
NOW, FREE_AT, PACE, STALL = 0, 1, 2, 3
COPY_S, LAYER_S, TOKEN_S, PACE_WEIGHT = 4, 5, 6, 7
FLOOR, MIN_PROB, MARGIN, MAX_HARM, LEAD = 8, 9, 10, 11, 12
CANDS_USE = 13  # forecast policy: the highest P(use within the forecast) among CANDS
HOST_S, LANE_FREE, HOST_END = 14, 15, 16  # host CPU: seconds per expert (inf: none), when idle, this layer's last output
READS_END = 17  # when the in-place reads of the layer being served end (-inf: none)
TWIN_S = 18  # seconds per twin read (0: no twins)
TWIN_LEFT, TWIN_W = 19, 20  # the current token's twin budget not yet spent; gate weight the twins served
NG = 21

# -- kinds ------------------------------------------------------------------------------------------
POLICY_LRU, POLICY_FORECAST, POLICY_FORECAST_LRU_VICTIMS = 0, 1, 2
PREFETCH_NONE, PREFETCH_DEADLINE = 0, 1
EV_DEMAND, EV_PREFETCH, EV_PROMOTE, EV_EVICT, EV_OFF_POOL = 1, 2, 3, 4, 5  # EV_OFF_POOL: deadline field an OFF_POOL index
# The miss rules' and paths' codes, from their registry (`seqmoe.brain.manager.miss_paths`); an EV_OFF_POOL
# event's deadline field holds the path's index in `miss_paths.OFF_POOL`.
MISS_COPY, MISS_IN_PLACE, MISS_CPU, MISS_AUTO = (MISS_RULES[name].code for name in MISS_RULES)
PATH_CPU_COPY = CPU_COPY.code  # on the host now, and copied into a slot behind
PATH_TWIN = TWIN.code  # its low-bit twin read

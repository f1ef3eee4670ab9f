"""The host tier: which expert rows a host cache of H rows holds in front of the disk.

    tier = HostTier(rows=H, num_layers=L, num_experts=E, policy=host_policy(system), read_s=d)
    ready = tier.need(uid, now)       # uid's row is in host memory at `ready` (read from disk if absent)
    tier.observe(uids); tier.note_forecast(fc); tier.plan_ahead(now)   # the forecast policy's inputs

One object decides for both users: the simulator, whose clock it prices (one disk channel, reads one
at a time, `read_s` each: latency + bytes / bandwidth), and the runtime's host cache
(`seqmoe.runtime.disk.host_cache`), which executes its decisions with real reads (its clock is not used). The
device pool's manager stays as it is: every transfer it orders (a copy, an in-place read, a host-CPU
expert) first `need`s the row here.

Policies (docs/DESIGN.md, "The disk tier"):
- "lru": evict the least recently needed row; read only what is needed (every system without a
  predictor: on-demand-lru, the oracles of the device tier).
- "forecast" (the systems with a predictor: seqmoe, moe-infinity-style, ...): a probabilistic Belady
  over the two horizons the system has: the forecaster's probabilities for the next positions and
  each expert's use rate per token (a moving average). An expert's expected next use, in tokens, is
  min(1 / rate, h / p) for a forecast probability p at h tokens ahead, later by DEVICE_TOKENS when
  the device pool holds it (`resident`); the row whose expected next use is furthest is evicted,
  and rows forecast with p >= AHEAD_P are read ahead while the disk is free, when they would come
  back sooner than the row they replace.
"""

from __future__ import annotations

import numpy as np

from seqmoe.base.errors import UserError

POLICIES = ("lru", "forecast")
RATE_WEIGHT = 1 / 64
"""Moving-average weight of one token in an expert's use rate (about 64 tokens' memory)."""
AHEAD_P = float("inf")
"""Least forecast probability of a read ahead: none by default, since on DeepSeek-V2-Lite's routing
every threshold tried read more bytes per token than none (docs/LOG.md, issue 29)."""
DEVICE_TOKENS = 1000.0
"""Tokens added to the expected next use of a row whose expert the device pool holds (`resident`):
the row is not needed until the device evicts it, so it goes before rows only the host has."""
_EPS = 1e-6
_LEAD = 1e15  # above any next-use score (LRU's are minus a count of needs)


class Stopped(Exception):
    """A wait for a free host row given up: its waiter stops (the runtime's `HostCache.hold(..., stop=)`)."""


class NoFreeRow(RuntimeError):
    """Every row of the host cache is busy (being read or used): nothing can be evicted now."""


def host_policy(system) -> str:
    """The host tier's policy for a device-tier `system`: "forecast" when it has a forecaster."""
    return "forecast" if system.predictor is not None else "lru"


class HostTier:
    """The rows of a host cache over L * E experts, decided by `policy`, with the disk's clock.

    Args:
        rows: H, rows of the host cache (at least 1).
        num_layers, num_experts: L, E.
        policy: "lru" or "forecast" (`POLICIES`).
        read_s: seconds per expert read from disk (the simulator's clock; 0 in the runtime).
        start: uids whose rows are in the cache at the start (at most H).
    """

    def __init__(self, rows: int, num_layers: int, num_experts: int, *, policy: str = "lru", read_s: float = 0.0,
                 start=()) -> None:
        if rows < 1:
            raise ValueError(f"the host cache needs at least one row, got {rows}")
        if policy not in POLICIES:
            raise ValueError(f"unknown host policy {policy!r}; choose from {', '.join(POLICIES)}")
        n = num_layers * num_experts
        self.rows, self.num_layers, self.num_experts, self.policy, self.read_s = rows, num_layers, num_experts, policy, read_s
        self.row_of = np.full(n, -1, dtype=np.int64)  # uid -> row, or -1: only on disk
        self.owner = np.full(rows, -1, dtype=np.int64)  # row -> uid, or -1: free
        self.ready_at = np.zeros(n)  # when the uid's read ends (simulator clock)
        self.used_at = np.zeros(n)  # a counter of needs, for LRU
        self.rate = np.zeros(n)  # uses per token, moving average (forecast policy)
        self.soon = np.full(n, np.inf)  # expected next use from the latest forecast, in tokens
        self.likely = np.zeros(n)  # the latest forecast's highest probability of each uid
        self.ahead = np.zeros(n, dtype=bool)  # read ahead and not needed since
        self.resident = None  # see `watch`
        self.follow = None
        self.disk_free_at = 0.0
        self._tick = 0.0
        self.hits = self.reads = self.ahead_reads = self.ahead_used = 0
        for u in list(start)[:rows]:
            self._place(int(u), self._free_row())

    def watch(self, *, resident=None, leader: HostTier | None = None) -> None:
        """What this tier sees beyond its own rows. `resident`: a callable giving the [L * E] mask of the
        uids the device pool holds (the manager's `present_mask`); the forecast policy evicts their rows
        first. `leader`: the tier this one follows (the runtime's real cache follows its simulated
        tier): it reads the leader's forecast inputs (`rate`, `soon`: the same arrays) and evicts
        first the rows the leader does not hold, so its contents track the leader's decisions."""
        if resident is not None:
            self.resident = resident
        if leader is not None:
            self.rate, self.soon, self.follow = leader.rate, leader.soon, leader.row_of

    # -- what the cache holds -----------------------------------------------------------------------
    def has(self, uid: int) -> bool:
        return self.row_of[uid] >= 0

    def _free_row(self) -> int:
        free = np.flatnonzero(self.owner < 0)
        return int(free[0]) if len(free) else -1

    def _place(self, uid: int, row: int) -> None:
        self.owner[row] = uid
        self.row_of[uid] = row

    def _next_use(self, uids: np.ndarray) -> np.ndarray:
        """Expected tokens until each of `uids` is needed again (larger: evicted first)."""
        if self.policy == "lru":
            nxt = -self.used_at[uids]
        else:
            recent = self.used_at[uids] / (self._tick + 1) * 1e-3  # ties go to the least recently needed
            nxt = np.minimum(1.0 / (self.rate[uids] + _EPS), self.soon[uids]) - recent
            if self.resident is not None:
                nxt = nxt + DEVICE_TOKENS * (self.resident()[uids] > 0)
        if self.follow is not None:  # rows the leading tier let go go first, in this policy's order
            nxt = nxt + _LEAD * (self.follow[uids] < 0)
        return nxt

    def victim(self, busy=None) -> int:
        """The uid to evict for an incoming row (none free), or -1 when every row is `busy`
        ([H] bool: rows being read or used)."""
        owners = self.owner
        score = self._next_use(owners)
        if busy is not None:
            score = np.where(busy, -np.inf, score)
        row = int(np.argmax(score))
        return -1 if busy is not None and busy[row] else int(owners[row])

    def _admit(self, uid: int, now: float, busy) -> float:
        """Read `uid` into a row (free, else the victim's); when its read ends."""
        row = self._free_row()
        if row < 0:
            old = self.victim(busy)
            if old < 0:
                raise NoFreeRow("every host row is being read or used")
            row = int(self.row_of[old])
            self.row_of[old] = -1
            self.ahead[old] = False
        self._place(uid, row)
        start = max(now, self.disk_free_at)
        self.disk_free_at = start + self.read_s
        self.ready_at[uid] = self.disk_free_at
        self.reads += 1
        return self.disk_free_at

    # -- decisions ----------------------------------------------------------------------------------
    def need(self, uid: int, now: float = 0.0, busy=None) -> float:
        """`uid`'s row is needed from `now`: a hit, else a read (evicting the victim); when it is in
        host memory. `busy`: [H] bool, rows that must not be evicted now."""
        self._tick += 1
        self.used_at[uid] = self._tick
        if self.row_of[uid] >= 0:
            self.hits += 1
            if self.ahead[uid]:
                self.ahead[uid] = False
                self.ahead_used += 1
            return max(now, float(self.ready_at[uid]))
        return self._admit(uid, now, busy)

    def begin_token(self) -> None:
        """A token starts: every use rate decays by one token's weight."""
        if self.policy == "forecast":
            self.rate *= 1 - RATE_WEIGHT

    def observe(self, uids) -> None:
        """The routers used `uids` at this position (the use rates learn it)."""
        if self.policy == "forecast":
            self.rate[np.asarray(uids, dtype=np.int64)] += RATE_WEIGHT

    def note_forecast(self, step: int, forecast) -> None:
        """The forecaster's latest `Forecast` (made at position `step`): the expected next use of the
        experts it names (h / p tokens for probability p at h tokens ahead), the others unknown."""
        if self.policy != "forecast" or forecast is None:
            return
        L, E = self.num_layers, self.num_experts
        steps = np.asarray(forecast.steps, dtype=np.int64)
        uids = (steps % L)[:, None] * E + np.arange(E)[None, :]
        ahead = np.maximum(steps - step, 1)[:, None] / L
        probs = np.asarray(forecast.probs, dtype=np.float64)
        self.soon[:] = np.inf
        self.likely[:] = 0.0
        np.minimum.at(self.soon, uids.ravel(), (ahead / np.maximum(probs, _EPS)).ravel())
        np.maximum.at(self.likely, uids.ravel(), probs.ravel())

    def plan_ahead(self, now: float = 0.0, limit: int = 8, busy=None, idle_only: bool = True) -> list[int]:
        """Forecast policy: read ahead up to `limit` rows forecast with p >= AHEAD_P (most likely
        first) that are not held, each only when it would be used sooner than the row it replaces;
        `idle_only`: only while the disk has no read queued (the simulator's channel). The uids read."""
        if self.policy != "forecast" or (idle_only and self.disk_free_at > now):
            return []
        cand = np.flatnonzero((self.likely >= AHEAD_P) & (self.row_of < 0))
        if not len(cand):
            return []
        cand = cand[np.argsort(self.soon[cand], kind="stable")][:limit]
        out = []
        for uid in cand.tolist():
            if self._free_row() < 0:
                old = self.victim(busy)
                if old < 0 or self._next_use(np.array([old]))[0] <= self._next_use(np.array([uid]))[0]:
                    break
            self._admit(uid, now, busy)
            self.ahead[uid] = True
            self.ahead_reads += 1
            out.append(uid)
        return out

    def drop(self, uid: int) -> None:
        """Forget `uid`'s row (the runtime's read of it failed)."""
        row = int(self.row_of[uid])
        if row >= 0:
            self.owner[row] = -1
            self.row_of[uid] = -1
            self.ahead[uid] = False


def host_rows_for(budget: int, expert_bytes: int, num_layers: int, num_experts: int, top_k: int, what: str,
                  reserved: int = 0) -> int:
    """H: the expert rows `budget` bytes of host memory hold after `reserved` bytes (low-bit twins) (at
    most L x E); UserError when fewer than two layers' K experts (one layer's being computed while the
    next one's are read)."""
    rows = min(max(0, budget - reserved) // expert_bytes, num_layers * num_experts)
    if rows < 2 * top_k:
        twins = f" ({reserved:,} of them for the low-bit twins)" if reserved else ""
        raise UserError(f"{what} holds {rows} experts of {expert_bytes:,} bytes; the host cache needs at least "
                        f"{2 * top_k} (two layers' routed experts): give at least {2 * top_k * expert_bytes + reserved:,} "
                        f"bytes{twins}")
    return int(rows)

"""`CompiledManager`: the driver API of `MemoryManager` over the compiled state (see `layout`)."""

from __future__ import annotations

import time

import numpy as np

from seqmoe.brain.policies.forecast import discount_table
import seqmoe.brain.manager.compiled.channel as channel
import seqmoe.brain.manager.compiled.ops as ops
import seqmoe.brain.manager.compiled.recency as recency
import seqmoe.brain.manager.compiled.step as step
from seqmoe.brain.manager.compiled.layout import (
    CANCELLED, CAP, COPY_S, COSTS_N, DONE_AT, FAR, EV_DEMAND, EV_EVICT, EV_OFF_POOL, EV_PREFETCH, EV_PROMOTE, E_, FLOOR,
    F_FIRST, GEOM, HOST, HOST_END, HOST_S, HOST_SERVED, IN_PLACE, JOBS_KEY_STEP, K_, LATE, LAYER, LAYER_S, LEAD, L_,
    MARGIN, MAX_HARM, MAX_JOBS, MAX_TRIES, MEMO_STEP, MIN_PROB, MISS, MISSES, NEV, NF, NG, NI, NS, NUM_COUNT_CLASSES,
    NUM_GAP_CLASSES, NUM_PRESENT, PACE, PACE_WEIGHT, PENDING, PF_QUEUED, POLICY, POLICY_FORECAST,
    POLICY_FORECAST_LRU_VICTIMS, POLICY_LRU, PREFETCHER, PREFETCHES, PREFETCH_DEADLINE, PREFETCH_NONE, PRESENT, QSEQ,
    PREV_GAP, PRIOR_END, NDIRTY, READS, READY, RECENT, RES, RES_AT, STALL, STARTED, STEP, TOKEN_S, TWINS,
    TWIN_LEFT, TWIN_READS, TWIN_S, TWIN_W, UCLASS, UROW, VERSION, WASTED,
)
from seqmoe.brain.manager.compiled.warm import warm_up
from seqmoe.brain.manager.counts import SimCounts
from seqmoe.brain.manager.miss_paths import OFF_POOL
from seqmoe.brain.manager.base import PACE_WEIGHT as PACE_W
from seqmoe.brain.manager.base import ManagerBase
from seqmoe.brain.schedule.deadline import DeadlinePrefetcher, price_of_copy


COMPILED_POLICIES = {"lru": POLICY_LRU, "forecast": POLICY_FORECAST, "forecast-lru-victims": POLICY_FORECAST_LRU_VICTIMS}
"""The policies the kernels implement, by the name a policy class gives as its `compiled_as`."""


def _policy_kind(policy) -> int | None:
    """The kernels of `policy`'s exact class (a subclass names its own), or None."""
    return COMPILED_POLICIES.get(type(policy).__dict__.get("compiled_as"))


def compile_blocker(system) -> str | None:
    """Why `CompiledManager` cannot run `system` (its policy, scheduler or forecast horizon), or None
    when it can."""
    kind = _policy_kind(system.policy)
    if kind is None:
        return f"its eviction policy {type(system.policy).__name__} has no compiled kernels (`compiled_as`)"
    if system.host_only:  # `cpu-all`: nothing to decide, the reference manager runs it
        return "it computes every expert on the host CPU: there is nothing to decide"
    pre, pred = system.prefetcher, system.predictor
    if pre is None:  # a predictor only observes: no forecast reaches the policy
        return None
    if type(pre) is not DeadlinePrefetcher:
        return f"its prefetch scheduler {type(pre).__name__} has no compiled kernels"
    if pre.policy is not system.policy or kind == POLICY_LRU:
        return "its deadline scheduler needs the forecast policy that evicts as its valuation"
    if pre.max_jobs > COSTS_N:
        return f"its deadline scheduler plans more than {COSTS_N} jobs at once"
    if pred is None or pred.horizon is None or pred.horizon > 2 * system.policy.num_layers:
        return "its forecast has no horizon within two tokens"
    return None


def compilable(system) -> bool:
    """True when `CompiledManager` runs `system` (`compile_blocker` finds nothing)."""
    return compile_blocker(system) is None


_NO_STEPS, _NO_PROBS = np.zeros(0, np.int64), np.zeros((0, 1), np.float32)  # `decide` without a new forecast
_NO_WEIGHTS = np.zeros(0, np.float64)  # a reveal without the twin path


class CompiledManager(ManagerBase):
    """The memory manager over compiled state for a `compilable` system. Arguments: `ManagerBase`."""

    takes_arrays = True

    def __init__(self, system, *, model, hardware, capacity: int, start, observer=None, on_forecast=None) -> None:
        super().__init__(system, model=model, hardware=hardware, capacity=capacity, start=start, observer=observer,
                         on_forecast=on_forecast)
        if not compilable(system):
            raise ValueError(f"system {system.name!r} cannot run compiled; use MemoryManager")
        warm_up(type(self))  # load the kernels now, not inside the first decisions' time
        L, E, K = self.num_layers, self.num_experts, self.top_k
        n = L * E
        self.I = np.zeros((NI, n), np.int64)
        self.F = np.zeros((NF, n), np.float64)
        self.F[FAR] = 1.0
        self.S = np.zeros(NS, np.int64)
        self.G = np.zeros(NG, np.float64)
        self.DQ = np.zeros((2, n + 1), np.int64)  # demand ring: (seq, uid)
        self.PH = np.zeros((3, 4 * n + 64), np.int64)  # prefetch heap: (deadline step, seq, uid)
        self.RQI = np.zeros(n + 1, np.int64)  # running copies ring: uid
        self.RQF = np.zeros(n + 1, np.float64)  # and completion time
        self.EV = np.zeros((4 * n + 64, 3), np.int64)  # events of one call
        self.buf = np.zeros(n + 1, np.int64)
        self._ones = np.ones(n, np.int64)  # one activation per expert: a batch-1 reveal's multiplicities
        I, F, S, G = self.I, self.F, self.S, self.G
        S[L_], S[E_], S[K_], S[CAP] = L, E, K, capacity
        I[QSEQ] = -1
        I[PF_QUEUED] = -1
        I[LAYER] = np.repeat(np.arange(L), E)
        F[DONE_AT] = np.nan
        G[COPY_S], G[LAYER_S], G[TOKEN_S], G[PACE], G[PACE_WEIGHT] = (self.copy_time_s, self.layer_s, self.token_s,
                                                                       self.layer_s, PACE_W)
        S[MISS] = self.miss.code  # the MISS_* kinds of `layout`
        G[HOST_S] = np.inf if self.host_expert_s is None else self.host_expert_s
        G[TWIN_S] = self.twin_time_s or 0.0
        self.TAB = np.zeros((0, 0), np.float64)
        self.DISC = np.zeros((2, 1), np.float64)
        self._setup_policy(system.policy)
        self._setup_prefetcher(system.prefetcher)
        start = np.asarray(list(start), dtype=np.int64)
        I[PRESENT, start] = 1
        S[NUM_PRESENT] = len(start)
        I[RES_AT] = -1
        I[RES, :len(start)] = start
        I[RES_AT, start] = np.arange(len(start))
        recency.policy_reset(I, F, S, start)
        S[JOBS_KEY_STEP] = S[MEMO_STEP] = -(1 << 40)
        S[STEP] = -1
        self._plans = S[PREFETCHER] != PREFETCH_NONE
        self._state = (I, F, S, G, self.DQ, self.PH, self.RQI, self.RQF)
        self._serve_args = self._state + (self.EV, self.TAB, self.DISC)
        self._plan_args = self._serve_args + ((self.JI, self.JF, self.WF, self.MI) if self._plans else ())
        self._no_forecast = (False, _NO_STEPS, _NO_PROBS, np.float32(0.0))  # `_forecast_args(None)`, built once
        self.decision_s = 0.0

    def _setup_policy(self, policy) -> None:
        I, F, S, G = self.I, self.F, self.S, self.G
        S[POLICY] = _policy_kind(policy)
        if S[POLICY] == POLICY_LRU:
            return
        L = self.num_layers
        G[FLOOR] = policy.floor
        F[GEOM] = policy._geometric
        # exp(-d / tau), exp(d / tau) for every distance the policy looks up (at most 3 L), as the reference's
        self.DISC = discount_table(policy.tau, 8 * L + 64)
        reuse = policy.reuse
        if reuse is not None:
            self.TAB = np.ascontiguousarray(reuse.values, dtype=np.float64)
            I[UCLASS] = reuse.uid_class
            S[NUM_GAP_CLASSES] = reuse.num_gap_classes
            S[NUM_COUNT_CLASSES] = reuse.num_count_classes
        S[F_FIRST] = 0

    def _setup_prefetcher(self, pre) -> None:
        S, G = self.S, self.G
        self._adaptive_margin = False
        if pre is None:
            S[PREFETCHER] = PREFETCH_NONE
            return
        S[PREFETCHER] = PREFETCH_DEADLINE
        self._adaptive_margin = pre.margin is None
        G[MIN_PROB], G[MAX_HARM] = pre.min_prob, pre.max_harm
        G[MARGIN] = price_of_copy(self.channel_use) if pre.margin is None else pre.margin
        G[LEAD] = -1.0 if pre.lead_copies is None else pre.lead_copies
        S[MAX_JOBS], S[MAX_TRIES] = pre.max_jobs, pre.max_tries
        self.JI = np.zeros((2, pre.max_jobs), np.int64)
        self.JF = np.zeros((2, pre.max_jobs), np.float64)
        self.MI = np.zeros((3, 4 * pre.max_tries), np.int64)
        n = self.num_layers * self.num_experts
        self.WF = np.zeros((1, n), np.float64)

    # -- the driver API ---------------------------------------------------------------------------------
    def token_start(self, step_: int, now: float, token_id: int | None) -> None:
        step.move_to(*self._state, step_ - 1, now, self.buf)
        self._note_channel(now, int(self.S[STARTED] + self.S[READS]), int(self.S[TWIN_READS]))
        if self.twin is not None:  # a step of B rows spends B tokens' budgets
            self.G[TWIN_LEFT] = self.twin.budget * (len(token_id) if isinstance(token_id, list) else 1)
        price = price_of_copy(self.channel_use) if self._adaptive_margin else self.G[MARGIN]
        if price != self.G[MARGIN]:
            self.G[MARGIN] = price
            self.S[JOBS_KEY_STEP] = -(1 << 40)  # the cached candidates were filtered by the old margin
        if self.predictor is None and not self._plans:
            return
        t0 = time.perf_counter()
        if self.predictor is not None:
            self.predictor.begin_token(step_, token_id)
            prior = self.predictor.take_prior()
            if prior is not None:
                self._set_prior(*prior)
            far = self.predictor.far
            if far is not None and self.S[POLICY] != POLICY_LRU:  # every cached prior and value is void
                self.system.policy.set_far(far)  # the Python object stays the description of the state
                self.F[FAR] = far
                self.S[PRIOR_END] = -(1 << 40)
                self.S[VERSION] += 1
        self._decide(step_ - 1)
        self.decision_s += time.perf_counter() - t0

    def _set_prior(self, use_rate: np.ndarray, reuse) -> None:
        """`ForecastPolicy.set_prior` on the compiled state: the prior's arrays replaced, each uid's
        row of the new table recomputed from its history, the caches voided."""
        I, F, S = self.I, self.F, self.S
        policy = self.system.policy
        policy.set_prior(use_rate, reuse)  # the Python object stays the description of the state
        F[GEOM] = policy._geometric
        if reuse is not None:
            self.TAB = np.ascontiguousarray(reuse.values, dtype=np.float64)
            I[UCLASS] = reuse.uid_class
            S[NUM_GAP_CLASSES], S[NUM_COUNT_CLASSES] = reuse.num_gap_classes, reuse.num_count_classes
            I[UROW] = reuse.rows(I[PREV_GAP], F[RECENT])
        else:
            self.TAB = np.zeros((0, 0), np.float64)
        S[PRIOR_END], S[NDIRTY] = -(1 << 40), 0
        S[VERSION] += 1
        self._serve_args = self._state + (self.EV, self.TAB, self.DISC)
        self._plan_args = self._serve_args + ((self.JI, self.JF, self.WF, self.MI) if self._plans else ())

    def layer(self, step_: int, needed: np.ndarray, ids, reveal: float, weights=None, mult=None) -> float:
        # One kernel call per reveal: inside a model's forward each first call after the forward pays
        # for cold caches (~20 us at seqmoe-tiny's dimensions), a call in the same burst ~1 us. The
        # predictor does not read the pool, so it observes and forecasts before the layer is served.
        t0 = time.perf_counter()
        pred, ok, fc, w = self.predictor, True, None, _NO_WEIGHTS
        if mult is None:
            mult = self._ones[:len(needed)]
        if pred is not None and ids is not None:
            pred.observe(step_, ids)
        if self.twin is not None:
            self._check_weights(weights)
            w = np.asarray(weights, dtype=np.float64)
        if self._plans:
            fc = self._forecast(step_)
            start, ok = step.layer(*self._plan_args, needed, mult, w, step_, reveal, self.buf,
                                           *self._forecast_args(fc))
        else:
            start = step.serve(*self._serve_args, needed, mult, w, step_, reveal, self.buf, True)
        if self.S[NEV]:
            self._deliver()
        self._check_fit(ok, fc)
        self.decision_s += time.perf_counter() - t0
        return start

    def layer_end(self, step_: int, now: float) -> None:
        t0 = time.perf_counter()
        step.end_layer(*self._plan_args, step_, now, self.buf)
        if self.S[NEV]:
            self._deliver()
        self.decision_s += time.perf_counter() - t0

    def _decide(self, step_: int) -> None:
        """A decision point without a reveal (token start): load the forecast, if any, and plan."""
        if not self._plans:
            return
        fc = self._forecast(step_)
        ok = step.decide(*self._plan_args, *self._forecast_args(fc))
        if self.S[NEV]:
            self._deliver()
        self._check_fit(ok, fc)

    def _forecast_args(self, fc) -> tuple:
        """The kernels' (new_forecast, steps, probs, floor) for a forecast or None (the floor in the
        dtype of the probabilities, as numpy compares them)."""
        if fc is None:
            return self._no_forecast
        return True, fc.steps, fc.probs, fc.probs.dtype.type(self.G[FLOOR])

    @staticmethod
    def _check_fit(ok: bool, fc) -> None:
        if not ok:
            raise ValueError(f"a forecast of {len(fc.steps)} positions does not fit the compiled policy")

    def _deliver(self) -> None:
        """Hand the events of the last call to the observer, in order."""
        n = int(self.S[NEV])
        if not n:
            return
        self.S[NEV] = 0
        obs = self.observer
        if obs is None:
            return
        for kind, uid, deadline in self.EV[:n].tolist():
            if kind == EV_DEMAND:
                obs.on_load(uid, True, deadline)
            elif kind == EV_PREFETCH:
                obs.on_load(uid, False, deadline)
            elif kind == EV_PROMOTE:
                obs.on_promote(uid)
            elif kind == EV_EVICT:
                obs.on_evict(uid)
            elif kind == EV_OFF_POOL:
                obs.on_off_pool(uid, OFF_POOL[deadline])

    # -- counts and views -----------------------------------------------------------------------------
    @property
    def c(self) -> SimCounts:
        S = self.S
        return SimCounts(ready=int(S[READY]), late=int(S[LATE]), misses=int(S[MISSES]), in_place=int(S[IN_PLACE]),
                         host=int(S[HOST]), twin=int(S[TWINS]), twin_weight=float(self.G[TWIN_W]), prefetches=int(S[PREFETCHES]), wasted_copies=int(S[WASTED]),
                         cancelled=int(S[CANCELLED]), stall_s=float(self.G[STALL]), decision_s=self.decision_s)

    # The driver's view of the host CPU's share of the current layer (`ManagerBase`).
    @property
    def host_served(self) -> int:
        return int(self.S[HOST_SERVED])

    @host_served.setter
    def host_served(self, n: int) -> None:
        self.S[HOST_SERVED] = n

    @property
    def host_end(self) -> float:
        return float(self.G[HOST_END])

    def add_stall(self, seconds: float) -> None:
        self.G[STALL] += seconds

    @property
    def copies(self) -> int:
        return int(self.S[STARTED])

    def present_mask(self) -> np.ndarray:
        """[L * E] 1 where the uid is resident or its copy issued (a read-only view)."""
        view = self.I[PRESENT].view()
        view.flags.writeable = False
        return view

    def readable_mask(self, now: float) -> np.ndarray:
        """[L * E] bool: resident with its copy done by `now` (`MemoryManager.readable_mask`)."""
        ops.finish_copies(*self._state, now, self.buf)
        return (self.I[PRESENT] == 1) & (self.I[PENDING] == 0)

    def finish(self) -> None:
        channel.advance(*self._state, np.inf, self.buf)

"""Named systems (eviction policy + predictor + prefetch scheduler), built by name.

    system = build_system("on-demand-lru", SystemInputs(train=train, test=test, capacity=C, start=start))

Each system declares what it is and what it needs (`SystemSpec`); everything that picks systems
(the CLI, the runtime, the benchmarks, the plots) reads these declarations instead of keeping
lists of names (the registry's mechanism: `seqmoe.brain.manager.registry`; importing this module
registers every system, so callers read the registry's names here). Systems that re-implement another
project's policy are named "-style"; their modules say where they simplify. Oracles read the replayed
trace's future.
"""

from __future__ import annotations

import copy

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.brain.manager.base import System
from seqmoe.brain.manager.registry import (
    ROLES,
    SYSTEMS,
    SystemInputs,
    SystemSpec,
    baselines,
    build_system,
    check_live_system,
    live_systems,
    oracles,
    register_system,
    system_spec,
    systems_with,
)
from seqmoe.brain.policies import BeladyPolicy, FutureUses, LayerLRUPolicy, LFUPolicy, LRUPolicy, belady_schedule
from seqmoe.brain.policies.forecast import ForecastPolicy
from seqmoe.brain.predict import AffinityPredictor, EAMPolicy, EAMPredictor
from seqmoe.brain.predict.baselines.expertflow import ExpertFlowPredictor
from seqmoe.brain.predict.drafters import TrueTokenDrafter, make_drafter
from seqmoe.brain.predict.baselines.oracle import OracleForecaster
from seqmoe.brain.predict.pregate import HybridPredictor, PregatePredictor, fit_alphas
from seqmoe.brain.schedule import GreedyPrefetcher, OraclePrefetcher
from seqmoe.brain.schedule.greedy import InsertBeforeLayer
from seqmoe.brain.schedule.deadline import DeadlinePrefetcher
from seqmoe.brain.schedule.expertflow import AdaptiveHorizonPrefetcher, ExpertFlowShared, TwoLevelLRUPolicy
from seqmoe.brain.schedule.base import Prefetcher

__all__ = ["ROLES", "SYSTEMS", "SystemInputs", "SystemSpec", "baselines", "build_system", "check_live_system",
           "live_systems", "oracles", "register_system", "system_spec", "systems_with"]


@register_system("on-demand-lru", "no prefetch; evict the least recently used expert", learns=False)
def _lru(inp: SystemInputs) -> System:
    return System("on-demand-lru", LRUPolicy())


@register_system("on-demand-lfu", "no prefetch; evict the least frequently used expert", learns=False)
def _lfu(inp: SystemInputs) -> System:
    return System("on-demand-lfu", LFUPolicy())


@register_system("belady", "no prefetch; oracle eviction of the expert used furthest in the future", role="oracle")
def _belady(inp: SystemInputs) -> System:
    t = inp.test
    return System("belady", BeladyPolicy(FutureUses(_visits(inp), t.num_layers * t.num_experts)))


def _visits(inp: SystemInputs) -> np.ndarray:
    """[S, L, W] global ids of the positions the replay visits, in order (the oracles' future)."""
    return inp.test.uids() if inp.visits is None else inp.visits


@register_system("mixtral-offloading-style", "no prefetch; LRU within equal per-layer groups", learns=False)
def _mixtral_offloading(inp: SystemInputs) -> System:
    t = inp.train
    return System("mixtral-offloading-style",
                  LayerLRUPolicy(num_layers=t.num_layers, num_experts=t.num_experts, capacity=inp.capacity))


@register_system("moe-infinity-style", "request activation-matrix matching, decayed prefetch, activation-aware eviction",
                 forecaster=lambda train, horizon: EAMPredictor(train, horizon=horizon))
def _moe_infinity(inp: SystemInputs) -> System:
    pred = EAMPredictor(inp.train)
    return System("moe-infinity-style", EAMPolicy(pred), pred, GreedyPrefetcher(min_prob=0.7, decay=True))


@register_system("affinity-style", "inter-layer transition statistics, prefetch of likely next experts, LRU",
                 forecaster=lambda train, horizon: AffinityPredictor(train, horizon=horizon))
def _affinity(inp: SystemInputs) -> System:
    return System("affinity-style", LRUPolicy(), AffinityPredictor(inp.train), GreedyPrefetcher(min_prob=0.3))


@register_system("moe-beyond-style", "predictions made elsewhere (--predictions), each layer's predicted set "
                 "inserted into an LRU right before the layer", learns=False, needs_predictions=True)
def _moe_beyond(inp: SystemInputs) -> System:
    # MoE-Beyond's rule (its cache_simulator): one global LRU, the predicted set inserted before the layer.
    policy = LRUPolicy()
    return System("moe-beyond-style", policy, inp.predictions, InsertBeforeLayer(policy))


@register_system("cpu-all", "every routed expert computed on the host CPU, no expert slots (as llama.cpp --cpu-moe)",
                 role="host", learns=False, miss="cpu")
def _cpu_all(inp: SystemInputs) -> System:
    return System("cpu-all", LRUPolicy(), host_only=True)


@register_system("static-split-style", "the most used experts stay resident, every other one is computed on the host "
                 "CPU (as llama.cpp --n-cpu-moe, ktransformers)", role="host", miss="cpu")
def _static_split(inp: SystemInputs) -> System:
    return System("static-split-style", LRUPolicy())  # misses go to the CPU, so the start placement never changes


EXPERTFLOW_THRESHOLD = 8
"""Stalls (or wasted prefetches) that move expertflow-style's prefetch distance by one (our choice)."""


def _has_pregate(inp: SystemInputs) -> bool:
    return inp.train.pregate_logits is not None and (inp.test.pregate_logits is not None or inp.pregate is not None)


def _pregate_source(inp: SystemInputs):
    """Where the replayed (or live) positions' pre-gate rows come from."""
    return inp.pregate if inp.pregate is not None else inp.test


def _hybrid(history, inp: SystemInputs):
    """`history` fused with pre-gating when both traces hold pre-gate scores (weights fitted on train)."""
    if not _has_pregate(inp):
        return history
    fitting = copy.deepcopy(history)
    if hasattr(fitting, "check_trace"):
        fitting.check_trace(inp.train)  # the training trace's vocabulary while the weights are fitted
    return HybridPredictor(history, _pregate_source(inp), fit_alphas(fitting, inp.train))


def _expertflow(name: str, inp: SystemInputs, adaptive: bool, predictor=None) -> System:
    shared = ExpertFlowShared(threshold=EXPERTFLOW_THRESHOLD)
    predictor = predictor or _hybrid(ExpertFlowPredictor(inp.train), inp)
    return System(name, TwoLevelLRUPolicy(shared, inp.train.num_layers), predictor,
                  AdaptiveHorizonPrefetcher(shared, adaptive=adaptive))


@register_system("expertflow-style", "distance-wise history forecast (fused with pre-gating when the traces have it), "
                 "adaptive prefetch distance, two-level LRU",
                 forecaster=lambda train, horizon: ExpertFlowPredictor(train, horizon=horizon))
def _expertflow_adaptive(inp: SystemInputs) -> System:
    return _expertflow("expertflow-style", inp, adaptive=True)


@register_system("expertflow-style-fixed-horizon", "ablation of expertflow-style: prefetch distance fixed at one layer")
def _expertflow_fixed(inp: SystemInputs) -> System:
    return _expertflow("expertflow-style-fixed-horizon", inp, adaptive=False)


@register_system("expertflow-style-pregate-only", "ablation of expertflow-style: pre-gate forecast alone "
                 "(needs traces collected with --pregate)", needs_pregate=True)
def _expertflow_pregate(inp: SystemInputs) -> System:
    if inp.test.pregate_logits is None and inp.pregate is None:
        raise UserError("expertflow-style-pregate-only needs a replayed trace with pre-gate scores "
                        "(seqmoe trace collect --pregate H)")
    return _expertflow("expertflow-style-pregate-only", inp, adaptive=True,
                       predictor=PregatePredictor(_pregate_source(inp)))


@register_system("oracle-prefetch", "perfect future, prefetch as early as slots allow, Belady eviction",
                 role="oracle")
def _oracle(inp: SystemInputs) -> System:
    t = inp.test
    uids = _visits(inp)
    future = FutureUses(uids, t.num_layers * t.num_experts)
    schedule = belady_schedule(uids, inp.capacity, inp.start, future)
    return System("oracle-prefetch", BeladyPolicy(future), None, OraclePrefetcher(schedule))


class _Feeding(Prefetcher):
    """A prefetcher that first hands each forecast to a `ForecastPolicy` (which needs it to rank)."""

    def __init__(self, policy: ForecastPolicy, inner) -> None:
        self.policy, self.inner = policy, inner

    def plan(self, forecast, view) -> None:
        self.policy.update(forecast, view.step)
        self.inner.plan(forecast, view)


def _prior(inp: SystemInputs, cls=ForecastPolicy) -> ForecastPolicy:
    """The seqmoe systems' eviction policy: its prior learned on the training trace, or (online) `inp.prior`."""
    if inp.prior is None:
        return cls.from_trace(inp.train)
    t = inp.train
    use_rate, reuse = inp.prior
    return cls(use_rate, num_layers=t.num_layers, num_experts=t.num_experts, reuse=reuse)


def _seq(inp: SystemInputs, far_head: bool = True):
    """The system's own forecaster: the trained one, with the memory manager's forecast window (and its
    long-range head, when it has one, unless `far_head` is False)."""
    if inp.predictor is None:
        raise UserError("this system needs a forecaster: pass --predictor DIR (see `seqmoe train`), or let it "
                        "learn online")
    from seqmoe.brain.predict.seqmodel import DEFAULT_WINDOW  # numba: config reads this module's specs

    predictor = inp.predictor.with_window(DEFAULT_WINDOW, far_head=far_head)
    predictor.check_trace(inp.test)  # binds the replayed trace's vocabulary to the token hashes
    return predictor.use_drafter(make_drafter(inp.draft, inp.train))


@register_system("seqmoe", "seq2seq forecast, deadline-aware joint prefetch, probabilistic Belady eviction",
                 role="seqmoe", needs_predictor=True)
def _seqmoe(inp: SystemInputs) -> System:
    policy = _prior(inp)
    return System("seqmoe", policy, _seq(inp), DeadlinePrefetcher(policy))


@register_system("seqmoe-hybrid", "seqmoe with its forecast fused with pre-gating (needs traces collected with --pregate)",
                 role="seqmoe", needs_predictor=True, needs_pregate=True)
def _seqmoe_hybrid(inp: SystemInputs) -> System:
    if not _has_pregate(inp):
        raise UserError("seqmoe-hybrid needs training and replayed traces with pre-gate scores "
                        "(seqmoe trace collect --pregate H)")
    policy = ForecastPolicy.from_trace(inp.train)
    history = inp.predictor.with_window(None)
    history.check_trace(inp.test)
    return System("seqmoe-hybrid", policy, _hybrid(history, inp), DeadlinePrefetcher(policy))


@register_system("seqmoe-greedy-prefetch", "ablation: seqmoe with greedy threshold prefetch instead of deadline scheduling",
                 role="ablation", needs_predictor=True)
def _seqmoe_greedy(inp: SystemInputs) -> System:
    policy = _prior(inp)
    return System("seqmoe-greedy-prefetch", policy, _seq(inp), _Feeding(policy, GreedyPrefetcher(min_prob=0.3)))


class _LRUVictims(ForecastPolicy):
    """Ablation: keep the forecast valuation (the scheduler's profits) but evict least recently used."""

    compiled_as = "forecast-lru-victims"

    def victim(self, incoming: int, pinned) -> int | None:
        last = np.where(self._resident, self._last, np.inf)
        last[[u for u in pinned if self._resident[u]]] = np.inf
        i = int(np.argmin(last))
        return None if last[i] == np.inf else i

    def victim_at(self, step: int, max_harm: float) -> tuple[int | None, bool]:
        return self.victim(-1, ()), False


@register_system("seqmoe-lru-eviction", "ablation: seqmoe with LRU eviction instead of probabilistic Belady",
                 role="ablation", needs_predictor=True)
def _seqmoe_lru(inp: SystemInputs) -> System:
    policy = _prior(inp, _LRUVictims)
    return System("seqmoe-lru-eviction", policy, _seq(inp), DeadlinePrefetcher(policy))


@register_system("seqmoe-no-far-head", "ablation: seqmoe without its forecaster's long-range head (a two-token "
                 "forecast, the reuse table alone beyond it)", role="ablation", needs_predictor=True)
def _seqmoe_no_far_head(inp: SystemInputs) -> System:
    policy = _prior(inp)
    return System("seqmoe-no-far-head", policy, _seq(inp, far_head=False), DeadlinePrefetcher(policy))


@register_system("seqmoe-markov-forecast", "ablation: seqmoe with a first-order Markov (affinity) forecast instead of seq2seq",
                 role="ablation")
def _seqmoe_markov(inp: SystemInputs) -> System:
    policy = ForecastPolicy.from_trace(inp.train)
    return System("seqmoe-markov-forecast", policy, AffinityPredictor(inp.train), DeadlinePrefetcher(policy))


@register_system("seqmoe-prior-eviction", "ablation: seqmoe's learned reuse prior alone (no forecast, no prefetch)",
                 role="ablation")
def _seqmoe_prior(inp: SystemInputs) -> System:
    return System("seqmoe-prior-eviction", ForecastPolicy.from_trace(inp.train))


@register_system("seqmoe-oracle-forecast", "seqmoe's scheduler and eviction fed the true next 20 tokens: its upper bound",
                 role="oracle")
def _seqmoe_oracle_forecast(inp: SystemInputs) -> System:
    t = inp.test
    policy = ForecastPolicy.from_trace(inp.train)
    # Re-planning after each layer's compute pays with a certain forecast (not with seqmoe's: docs/LOG.md).
    return System("seqmoe-oracle-forecast", policy, OracleForecaster(t, 20 * t.num_layers, inp.visits),
                  DeadlinePrefetcher(policy, replan_after_compute=True))


@register_system("seqmoe-oracle-draft", "seqmoe-no-far-head fed the true next token as its draft (confidence 1): "
                 "drafting's ceiling (a trace without token ids drafts nothing)",
                 role="oracle", needs_predictor=True)
def _seqmoe_oracle_draft(inp: SystemInputs) -> System:
    policy = _prior(inp)
    predictor = _seq(inp, far_head=False).use_drafter(TrueTokenDrafter(inp.test))  # guesses feed the next token's rows
    return System("seqmoe-oracle-draft", policy, predictor, DeadlinePrefetcher(policy))

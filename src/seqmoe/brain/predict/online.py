"""The sequence forecaster learned online, from the routing a run serves: no trace, no training step.

    fc = OnlineForecaster(online_config(L, E, K), InlineLearner(OnlineTrainer(cfg)))   # the simulator
    fc = OnlineForecaster(cfg, ProcessLearner(cfg, save_to=dir), weights=cached)           # the runtime (learner.py)

The forecaster records the routing of every whole token into a ring of the last
`OnlineSchedule.buffer` tokens. From `warmup` tokens on, every `period` tokens it hands a snapshot
of the ring to its learner, which trains its own copy of the network one pass over it
(`seqmoe.brain.predict.train.OnlineTrainer`) and refits the eviction policy's prior on it (use rates
and reuse table, `fit_prior`); both are swapped in at the first token start at least `lag` tokens
after the snapshot at which they are ready. A swap happens inside `begin_token`, which the memory
manager calls at a token start (it then hands `new_prior` to its policy): between tokens, never
inside a decision, on whichever thread runs the control plane. Until the first swap it forecasts
nothing, and the policy's starting prior decides alone.

The schedule counts tokens, not seconds, so a replay is deterministic: the simulator's
`InlineLearner` trains synchronously and its weights are ready at `lag`; the runtime's
`ProcessLearner` trains in a child process at low priority and one torch thread (the decode step
never waits for it), and its weights are swapped at `lag` when ready by then, later otherwise;
`swaps` lists (snapshot token, swap token) either way. Training is seeded and single-threaded, so
the same snapshots give the same weights in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqmoe.brain.policies.forecast import ForecastPolicy
from seqmoe.brain.policies.reuse import ReuseTable
from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.brain.predict.buckets import bucket_of, bucket_table
from seqmoe.brain.predict.seqmodel import DEFAULT_WINDOW, SeqConfig, SeqPredictor
from seqmoe.trace.schema import RoutingTrace, check_dims, snapshot_trace

FINAL_ROUND_MIN = 16
"""Tokens a run must have seen since the last round for its close to learn (and keep) one more."""
ONLINE_DIMS = {"hash_buckets": 4096, "embed_dim": 128, "hidden_dim": 128, "query_dim": 128}
"""The online forecaster's widths: half the offline one's, so a round trains in about a second."""


def online_config(num_layers: int, num_experts: int, top_k: int) -> SeqConfig:
    """The architecture of the online forecaster of a model with these L, E, K."""
    return SeqConfig(num_layers=num_layers, num_experts=num_experts, top_k=top_k, **ONLINE_DIMS)


@dataclass(frozen=True)
class OnlineSchedule:
    """When the online forecaster learns, in tokens."""

    warmup: int = 128
    """Tokens seen before the first round."""
    period: int = 512
    """Tokens between two rounds' snapshots (a round starts only once the previous one is swapped in)."""
    lag: int = 64
    """Tokens after its snapshot before a round's weights are swapped in (what one round may take)."""
    buffer: int = 16384
    """Tokens of routing a snapshot holds (the most recent; 4,096 came 0.6 % slower on DeepSeek-V2-Lite
    at r = 0.65: docs/LOG.md)."""


def cold_prior(num_layers: int, num_experts: int, top_k: int,
               use_rate: np.ndarray | None = None) -> tuple[np.ndarray, ReuseTable]:
    """The prior an online seqmoe system starts from, before its first round refits it: `use_rate`
    (uniform K / E when not given) and a reuse table by age alone, one token's discount raised to the
    age (an expert unused for a tokens is expected back in about a tokens: least recent goes first,
    as LRU, and within a token the layer furthest ahead)."""
    if use_rate is None:
        use_rate = np.full(num_layers * num_experts, top_k / num_experts)
    rho = np.exp(-0.5)  # one token's discount at the policy's default tau = 2 L
    values = rho ** (2.0 ** np.arange(16))[None, :]
    return use_rate, ReuseTable(values, np.zeros(num_layers * num_experts, dtype=np.int64))


def fit_prior(ids: np.ndarray, starts: np.ndarray, num_experts: int) -> tuple[np.ndarray, ReuseTable]:
    """(use rate [L * E], reuse table) of a snapshot: what `ForecastPolicy.from_trace` learns from a
    training trace, with its default discount."""
    trace = snapshot_trace(ids, starts, num_experts)
    counts = np.bincount(trace.uids().reshape(-1), minlength=trace.num_layers * num_experts)
    return counts / trace.num_tokens, ForecastPolicy.from_trace(trace).reuse


def learn_round(trainer, snapshot: tuple) -> tuple[dict, tuple]:
    """One round: (the trained weights, the refitted prior)."""
    ids, buckets, starts = snapshot
    return trainer.round(ids, buckets, starts), fit_prior(ids, starts, trainer.net.cfg.num_experts)


class InlineLearner:
    """Trains each snapshot at once, in this process (the simulator's learner)."""

    def __init__(self, trainer) -> None:
        self.trainer, self._result = trainer, None

    def submit(self, snapshot: tuple, tokens_learned: int) -> None:
        self._result = learn_round(self.trainer, snapshot)

    def result(self) -> tuple | None:
        got, self._result = self._result, None
        return got

    def close(self) -> None:
        pass


class NoLearner:
    """Learning paused: rounds are never run, the forecaster stays as it starts."""

    def submit(self, snapshot: tuple, tokens_learned: int) -> None:
        pass

    def result(self) -> None:
        return None

    def close(self) -> None:
        pass


def online_forecaster(num_layers: int, num_experts: int, top_k: int, *, seed: int = 0,
                      schedule: OnlineSchedule = OnlineSchedule()) -> OnlineForecaster:
    """A fresh online forecaster learning in this process (`InlineLearner`: the simulator's)."""
    from seqmoe.brain.predict.train import OnlineTrainer  # torch: only when this runs

    cfg = online_config(num_layers, num_experts, top_k)
    return OnlineForecaster(cfg, InlineLearner(OnlineTrainer(cfg, seed=seed)), schedule)


class OnlineForecaster(Predictor):
    """A `Predictor` whose sequence forecaster is learned from the routing it observes (module doc).

    Args:
        config: the forecaster's architecture (`online_config`).
        learner: an `InlineLearner` or a `ProcessLearner`.
        schedule: when it learns.
        weights: weights to forecast with from the start (a cached forecaster's), else none until the first swap.
        tokens_learned: tokens the starting weights learned from.
        source: where the starting weights came from: "cache" or "new".
        replay: (snapshot token, swap token) pairs to learn and swap at exactly, in place of the
            schedule's: a live run's `swaps`, so a replay of its trace decides as it did.
    """

    def __init__(self, config: SeqConfig, learner, schedule: OnlineSchedule = OnlineSchedule(), *,
                 weights: dict | None = None, tokens_learned: int = 0, source: str = "new",
                 replay: list | None = None) -> None:
        self.config, self.learner, self.schedule = config, learner, schedule
        self.L, self.E, self.K = config.num_layers, config.num_experts, config.top_k
        self.inner = None if weights is None else SeqPredictor(config, weights, window=DEFAULT_WINDOW)
        self.source, self.tokens_learned, self._base_learned = source, tokens_learned, tokens_learned
        self.swaps: list[tuple[int, int]] = []
        self._snapped = 0  # tokens seen at the last round's snapshot
        self.kept: int | None = None  # tokens the forecaster saved at close had learned (None: none saved)
        n = schedule.buffer
        self._ids = np.zeros((n, self.L, self.K), dtype=np.int16)
        self._buckets = np.zeros(n, dtype=np.int64)
        self._starts = np.zeros(n, dtype=bool)
        self.tokens = 0  # whole tokens recorded so far (the schedule's clock)
        self._cur = np.zeros((self.L, self.K), dtype=np.int16)
        self._cur_bucket, self._cur_start, self._cur_layers = config.hash_buckets, False, -1
        self._new_request = True
        self._table: np.ndarray | None = None
        self._pending: int | None = None  # the token count at the snapshot in flight
        self._next_round = schedule.warmup
        self._replay = None if replay is None else [tuple(x) for x in replay]
        self.new_prior: tuple | None = None
        """(use rates, reuse table) of the latest swap, until the memory manager takes it."""
        self.drafter = None

    @property
    def horizon(self) -> int:
        return 2 * self.L

    def with_window(self, window: int | None, *, far_head: bool = True) -> OnlineForecaster:
        """Itself: the online forecaster always forecasts once per token (`DEFAULT_WINDOW`)."""
        return self

    def use_drafter(self, drafter) -> OnlineForecaster:
        """As `SeqPredictor.use_drafter`, for the forecaster it has and every one it learns."""
        self.drafter = drafter
        if self.inner is not None:
            self.inner.use_drafter(drafter)
        return self

    def fork(self) -> _Follower:
        """A batch lane (`seqmoe.brain.predict.lanes`): forecasts with this forecaster's weights as they are
        swapped in, from its own state; learns nothing (this one learns from lane 0's routing)."""
        return _Follower(self)

    def check_trace(self, trace: RoutingTrace) -> None:
        """As `SeqPredictor.check_trace`: L, E, K must match; token ids hash through the trace's vocabulary."""
        check_dims("the trace", trace, self.config, "the online forecaster follows the model it serves")
        self._table = bucket_table(trace, self.config.hash_buckets)
        if self.inner is not None:
            self.inner._table = self._table

    # -- Predictor protocol -----------------------------------------------------------------------
    def begin_request(self) -> None:
        self._new_request = True
        if self.inner is not None:
            self.inner.begin_request()

    def begin_token(self, step: int, token_id: int | None) -> None:
        self._close_token()
        self._learn()
        self._cur_bucket = bucket_of(token_id, self._table, self.config.hash_buckets)
        self._cur_start, self._new_request, self._cur_layers = self._new_request, False, 0
        if self.inner is not None:
            self.inner.begin_token(step, token_id)

    def observe(self, step: int, ids: np.ndarray) -> None:
        layer = step % self.L
        if self._cur_layers == layer:
            self._cur[layer] = ids
            self._cur_layers += 1
        if self.inner is not None:
            self.inner.observe(step, ids)

    def predict(self, step: int) -> Forecast | None:
        return None if self.inner is None else self.inner.predict(step)

    def use_learner(self, learner) -> None:
        """Learn through `learner` from now on (the runtime starts its process learner once the model is
        offloaded)."""
        self.learner = learner

    def close(self) -> None:
        """Stop the learner (the runtime's close and restore). A learner that keeps its rounds first gets
        one last round of the tokens no round has learned yet (at least `FINAL_ROUND_MIN`), so a short run
        leaves what it saw for the next one; `kept` then says how many tokens the kept forecaster learned."""
        learner, snapped = self.learner, self._pending
        if getattr(learner, "keeps", False) and learner.failed is None and snapped is None and \
                self.tokens - self._snapped >= FINAL_ROUND_MIN:
            learner.submit(self._snapshot(), self._base_learned + self.tokens)
            snapped = self.tokens
        if learner.close() and snapped is not None:
            self.kept = self._base_learned + snapped

    def stats(self) -> dict:
        """Where the forecaster came from, how many tokens it has learned from, and its swaps."""
        return {"source": self.source, "tokens_learned": self.tokens_learned, "tokens_seen": self.tokens, "kept": self.kept,
                "swaps": len(self.swaps), "swap_tokens": [list(s) for s in self.swaps]}

    # -- learning ---------------------------------------------------------------------------------
    def _close_token(self) -> None:
        """The token that just ended, if every layer of it was observed, joins the ring."""
        if self._cur_layers != self.L:
            return
        i = self.tokens % self.schedule.buffer
        self._ids[i], self._buckets[i], self._starts[i] = self._cur, self._cur_bucket, self._cur_start
        self.tokens += 1
        self._cur_layers = -1

    def _learn(self) -> None:
        """Swap in a finished round that is due; start the next round when one is due."""
        s, n = self.schedule, self.tokens
        if self._replay is not None:
            self._learn_as_recorded(n)
            return
        if self._pending is not None and n >= self._pending + s.lag:
            got = self.learner.result()
            if got is not None:
                self._swap_in(got, n)
        if self._pending is None and n >= self._next_round:
            self.learner.submit(self._snapshot(), self._base_learned + n)
            self._pending, self._next_round, self._snapped = n, n + s.period, n

    def _learn_as_recorded(self, n: int) -> None:
        """`_learn` at the recorded (snapshot, swap) tokens."""
        k = len(self.swaps)
        if self._pending is not None and k < len(self._replay) and n == self._replay[k][1]:
            self._swap_in(self.learner.result(), n)
            k += 1
        if self._pending is None and k < len(self._replay) and n == self._replay[k][0]:
            self.learner.submit(self._snapshot(), self._base_learned + n)
            self._pending = n

    def _swap_in(self, got: tuple, n: int) -> None:
        """The round of the snapshot in flight, `got` = (weights, prior), from token `n` on."""
        self._swap(got[0])
        self.new_prior = got[1]
        self.swaps.append((self._pending, n))
        self.tokens_learned = self._base_learned + self._pending
        self._pending = None

    def _snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, buckets, starts) of the ring's tokens, oldest first."""
        n, size = self.tokens, self.schedule.buffer
        order = np.arange(max(0, n - size), n) % size
        return self._ids[order], self._buckets[order], self._starts[order]

    def _swap(self, weights: dict) -> None:
        if self.inner is None:
            self.inner = SeqPredictor(self.config, weights, window=DEFAULT_WINDOW).use_drafter(self.drafter)
            self.inner._table = self._table
        else:
            self.inner.set_weights(weights)


class _Follower(Predictor):
    """`OnlineForecaster.fork`: a `Predictor` on the parent's current weights."""

    def __init__(self, parent: OnlineForecaster) -> None:
        self.parent, self.inner, self._weights = parent, None, None

    @property
    def far(self):
        return None if self.inner is None else self.inner.far

    def begin_request(self) -> None:
        if self.inner is not None:
            self.inner.begin_request()

    def begin_token(self, step: int, token_id: int | None) -> None:
        source = self.parent.inner
        if source is not None and source.w is not self._weights:  # a swap: follow it between tokens
            if self.inner is None:
                self.inner = source.fork()
            else:
                self.inner.set_weights(source.w)
            self._weights = source.w
        if self.inner is not None:
            self.inner.begin_token(step, token_id)

    def observe(self, step: int, ids: np.ndarray) -> None:
        if self.inner is not None:
            self.inner.observe(step, ids)

    def predict(self, step: int) -> Forecast | None:
        return None if self.inner is None else self.inner.predict(step)


def forecaster_stats(predictor) -> dict | None:
    """What `runtime.stats()["forecaster"]` says of a system's forecaster: where it came from
    (`source`: "given", "cache" or "new") and how many tokens it has learned from; None without one."""
    if isinstance(predictor, OnlineForecaster):
        return predictor.stats()
    if isinstance(predictor, SeqPredictor):
        return {"source": "given", "tokens_learned": predictor.info.get("training", {}).get("trace", {}).get("tokens", 0)}
    return None

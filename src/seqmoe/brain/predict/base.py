"""Predictors: from the routing seen so far, the probability of each expert at future positions.

A position is one (token, layer) pair in execution order, `step = t * L + layer_id`. The
simulator and the runtime call, for every token and layer in decode order:

    predictor.begin_request()                 # a new request starts (history resets)
    predictor.begin_token(step, token_id)     # step = t * L, before layer 0 routes
    predictor.observe(step, ids)              # ids: [K] expert ids the layer at `step` chose
    predictor.predict(step) -> Forecast       # positions after `step`
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Forecast:
    """Expert-use probabilities for future positions.

    Attributes:
        steps: [H] int64, future positions (strictly after the current one), increasing.
        probs: [H, E] float32, probability that expert e is used at `steps[h]`
            (layer `steps[h] % L`); a row sums to about K.
    """

    steps: np.ndarray
    probs: np.ndarray


class Predictor(ABC):
    """What a predictor must do (the abstract methods) and what the manager may read of it (the
    attributes and `fork`, each with a default here)."""

    horizon: int | None = None
    """Positions after the current one its forecasts cover (None: not bounded); the compiled manager
    runs forecasts of at most 2 L positions."""
    far: np.ndarray | None = None
    """The long-range head's [L * E] probability of a use within its far horizon, for the current
    token (None: no head); the manager hands it to the policy (`EvictionPolicy.set_far`)."""
    new_prior: tuple | None = None
    """A prior beyond the forecast refitted at this token start, (use rates [L * E], `ReuseTable` or
    None): the manager hands it to the policy once (`EvictionPolicy.set_prior`) and clears it."""
    replay_tokens = None
    """What a batched replay points at each step's trace tokens (an object with `tokens`: one per row,
    None after), for what it reads of the trace by token (pre-gate rows, an oracle's drafts), or None."""

    @abstractmethod
    def begin_request(self) -> None:
        """A new request starts: forget the request-level history."""

    @abstractmethod
    def begin_token(self, step: int, token_id: int | None) -> None:
        """A token starts; `step` is its layer-0 position; `token_id` when the trace has them."""

    @abstractmethod
    def observe(self, step: int, ids: np.ndarray) -> None:
        """The layer at `step` routed to `ids` ([K] int expert ids)."""

    @abstractmethod
    def predict(self, step: int) -> Forecast | None:
        """Forecast for positions after `step`; None when there is nothing new to say (the last
        forecast, if any, stands)."""

    def forecast(self, step: int, horizon: int) -> Forecast | None:
        """A forecast covering at least `horizon` positions after `step`, for those that can look
        further when asked (evaluation, pre-gate fusion); default: `predict(step)`."""
        return self.predict(step)

    def take_prior(self) -> tuple | None:
        """`new_prior`, once: the manager takes it at a token start and hands it to its policy."""
        prior = self.new_prior
        if prior is not None:
            self.new_prior = None
        return prior

    def fork(self) -> Predictor:
        """A predictor for another sequence of a batch, sharing what was learned (default: a copy)."""
        return copy.deepcopy(self)

    def set_row(self, row: int) -> None:
        """This predictor's sequence is row `row` of the step that starts (a lane of a batch; 0 alone):
        where a per-row input of the step (pre-gate rows) is found. Default: nothing reads it."""


class IgnoresHistory(Predictor):
    """Base of predictors whose forecast does not depend on the routing seen so far."""

    def begin_request(self) -> None:
        pass

    def begin_token(self, step: int, token_id: int | None) -> None:
        pass

    def observe(self, step: int, ids: np.ndarray) -> None:
        pass


def topk_hits(probs: np.ndarray, truth: np.ndarray, k: int) -> np.ndarray:
    """How many true experts land in the top-k of each row.

    Args:
        probs: [N, E] float, forecast rows.
        truth: [N, K] int, the experts really used.
        k: how many top entries count (ties broken by argpartition, i.e. arbitrarily).

    Returns:
        [N] int64, |top-k(row) ∩ truth| per row.
    """
    N, E = probs.shape
    if k >= E:
        return np.full(N, truth.shape[1], dtype=np.int64)
    top = np.argpartition(-probs, k - 1, axis=1)[:, :k]  # [N, k]
    chosen = np.zeros((N, E), dtype=bool)
    np.put_along_axis(chosen, top, True, axis=1)
    return np.take_along_axis(chosen, truth.astype(np.int64), axis=1).sum(axis=1)

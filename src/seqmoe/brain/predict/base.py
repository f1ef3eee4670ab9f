"""Predictors: from the routing seen so far, the probability of each expert at future positions.

A position is one (token, layer) pair in execution order, `step = t * L + layer_id`. The
simulator and the runtime call, for every token and layer in decode order:

    predictor.begin_request()                 # a new request starts (history resets)
    predictor.begin_token(step, token_id)     # step = t * L, before layer 0 routes
    predictor.observe(step, ids)              # ids: [K] expert ids the layer at `step` chose
    predictor.predict(step) -> Forecast       # positions after `step`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


class Predictor(Protocol):
    def begin_request(self) -> None:
        """A new request starts: forget the request-level history."""

    def begin_token(self, step: int, token_id: int | None) -> None:
        """A token starts; `step` is its layer-0 position; `token_id` when the trace has them."""

    def observe(self, step: int, ids: np.ndarray) -> None:
        """The layer at `step` routed to `ids` ([K] int expert ids)."""

    def predict(self, step: int) -> Forecast | None:
        """Forecast for positions after `step`; None when there is nothing new to say (the last
        forecast, if any, stands)."""


class IgnoresHistory:
    """Mixin for predictors whose forecast does not depend on the routing seen so far."""

    def begin_request(self) -> None:
        pass

    def begin_token(self, step: int, token_id: int | None) -> None:
        pass

    def observe(self, step: int, ids: np.ndarray) -> None:
        pass

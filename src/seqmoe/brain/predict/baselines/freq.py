"""Frequency forecasting: every position gets its layer's popularity in the training split.

The weakest sensible baseline: it ignores the request, the token and the routing so far.

    pred = FrequencyPredictor(train)        # horizon defaults to 2L positions
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.predict.base import Forecast, IgnoresHistory
from seqmoe.trace import stats
from seqmoe.trace.schema import RoutingTrace


def layer_popularity(train: RoutingTrace) -> np.ndarray:
    """[L, E] float32: the fraction of training tokens that used each expert (rows sum to K)."""
    return (stats.layer_popularity(train) * train.top_k).astype(np.float32)


class FrequencyPredictor(IgnoresHistory):
    """Forecast each of the next `horizon` positions with its layer's training popularity."""

    def __init__(self, train: RoutingTrace, horizon: int | None = None) -> None:
        self.num_layers = train.num_layers
        self.horizon = horizon or 2 * train.num_layers
        self.pop = layer_popularity(train)  # [L, E]

    def predict(self, step: int) -> Forecast:
        steps = np.arange(step + 1, step + 1 + self.horizon, dtype=np.int64)
        return Forecast(steps, self.pop[steps % self.num_layers])

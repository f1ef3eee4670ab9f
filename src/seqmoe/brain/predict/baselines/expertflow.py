"""expertflow-style forecasting: a cross-layer predictor learned per distance from routing history.

ExpertFlow (Shen et al. 2025) fuses the pre-gate guess (later layers' routers applied to the
current hidden state) with the tokens and the experts used in recent layers, a small model (a
random forest) learning the correction from the guess to the real routing, for distances out to
about 20 layers. This module is the history part; the `expertflow-style` system fuses it with
pre-gating (`seqmoe.brain.predict.pregate.HybridPredictor`) when the traces hold pre-gate scores (collected
with `--pregate`; the DeepSeek-V2-Lite and Mixtral traces and the shipped seqmoe-tiny ones do not).
Simplification: the learner is a table per distance instead of a forest: for each
source layer and distance d = 1..H, the probability of every expert d positions ahead given each
expert used now, counted on the training split (`affinity.fit_transitions(gap=d)`: fitted
directly at each distance, not chained from one-step transitions as `affinity-style` does). The
forecast averages the rows of the experts used at the last `recent` observed positions, each
looked up at its own distance.
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.predict.baselines.affinity import fit_transitions
from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.trace.schema import RoutingTrace


class ExpertFlowPredictor(Predictor):
    """Forecast the next `horizon` positions from the experts of the last `recent` positions."""

    def __init__(self, train: RoutingTrace, horizon: int | None = None, recent: int = 2) -> None:
        self.num_layers = train.num_layers
        self.horizon = horizon or train.num_layers
        self.recent = recent
        # direct[g - 1][l] : [E, E], use g positions after a layer-l position (g = 1 .. horizon + recent - 1)
        self.direct = np.stack([fit_transitions(train, gap=g) for g in range(1, self.horizon + recent)])
        self._seen: list[tuple[int, np.ndarray]] = []  # (step, ids) of the last `recent` positions

    def begin_request(self) -> None:
        self._seen = []

    def begin_token(self, step: int, token_id: int | None) -> None:
        pass

    def observe(self, step: int, ids: np.ndarray) -> None:
        self._seen = (self._seen + [(step, np.asarray(ids, dtype=np.int64))])[-self.recent:]

    def predict(self, step: int) -> Forecast | None:
        if not self._seen:
            return None
        L, H = self.num_layers, self.horizon
        probs, used = np.zeros((H, self.direct.shape[-1]), dtype=np.float32), 0
        for s, ids in self._seen:
            first = step + 1 - s  # the gap from position s to step + 1
            if first > self.recent:
                continue
            probs += self.direct[first - 1:first - 1 + H, s % L][:, ids].mean(axis=1)
            used += 1
        if not used:
            return None
        probs /= used
        return Forecast(np.arange(step + 1, step + 1 + H, dtype=np.int64), np.minimum(probs, 1.0))

"""One predictor state per sequence of a decode batch, seen by the memory manager as one predictor.

A batched step routes B rows at each layer; each row's sequence has its own history, so each lane
(a batch row's place, reused by the next request when one ends) keeps its own predictor state:
lane 0 is the system's predictor itself, the others are its forks (`fork()` where the predictor
has one: the same weights, a fresh state; else a deep copy). The layer needs the union of its
rows' experts, so the forecast handed on is, per future position and expert, the probability
that any row uses it: 1 - prod_b (1 - p_b), the rows taken as independent.
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.predict.base import Forecast, Predictor


class LanePredictors(Predictor):
    """`Predictor` over the lanes of a batch (module doc); `step_start` of the driver sets the rows."""

    def __init__(self, first) -> None:
        self._lanes = [first]
        self._rows = [0]  # the lanes of the current step's rows, in row order
        self._last: dict[int, Forecast] = {}  # each lane's latest forecast
        self.far: np.ndarray | None = None
        """The long-range head's values of the step: per expert, the largest over its rows (the
        soonest next use), or None when the lanes' predictors have no head."""

    @property
    def first(self):
        """Lane 0's predictor: the system's own (what `stats()` reports)."""
        return self._lanes[0]

    @property
    def horizon(self):
        return self._lanes[0].horizon

    @property
    def new_prior(self):
        """Lane 0's refitted prior (an online forecaster learns from lane 0's routing)."""
        return self._lanes[0].new_prior

    @new_prior.setter
    def new_prior(self, value) -> None:
        self._lanes[0].new_prior = value

    def lane(self, b: int):
        """Lane `b`'s predictor (forked from lane 0 when first asked for)."""
        while len(self._lanes) <= b:
            twin = self._lanes[0].fork()
            twin.begin_request()
            self._lanes.append(twin)
        return self._lanes[b]

    def set_rows(self, lanes: list[int]) -> None:
        """The next step's rows are these lanes, in order."""
        for b in lanes:
            self.lane(b)
        self._rows = list(lanes)

    # -- Predictor protocol, per lane --------------------------------------------------------------
    def begin_request(self, lane: int = 0) -> None:
        self.lane(lane).begin_request()
        self._last.pop(lane, None)

    def begin_token(self, step: int, token_ids) -> None:
        """`token_ids`: one per row of the step (a single id: a batch-1 token of lane 0)."""
        if not isinstance(token_ids, list):
            token_ids, self._rows = [token_ids], [0]
        fars = []
        for i, (b, token) in enumerate(zip(self._rows, token_ids)):
            p = self._lanes[b]
            p.set_row(i)
            p.begin_token(step, token)
            if p.far is not None:
                fars.append(p.far)
        self.far = None if not fars else fars[0] if len(fars) == 1 else np.maximum.reduce(fars)

    def observe(self, step: int, ids: np.ndarray) -> None:
        """`ids`: [B, K], a row per lane of the step ([K]: batch 1)."""
        rows = ids if ids.ndim == 2 else ids[None]
        for b, row in zip(self._rows, rows):
            self._lanes[b].observe(step, row)

    def predict(self, step: int) -> Forecast | None:
        new = False
        for b in self._rows:
            fc = self._lanes[b].predict(step)
            if fc is not None:
                self._last[b] = fc
                new = True
        if not new:
            return None
        got = [self._last[b] for b in self._rows if b in self._last]
        return got[0] if len(got) == 1 else union_forecast(got, step)


def union_forecast(forecasts: list[Forecast], step: int) -> Forecast:
    """Per position after `step` and expert, the probability that any of `forecasts` (independent)
    uses it; positions any of them covers."""
    steps = np.unique(np.concatenate([f.steps for f in forecasts]))
    steps = steps[steps > step]
    miss = np.ones((len(steps), forecasts[0].probs.shape[1]), dtype=np.float32)
    for f in forecasts:
        keep = f.steps > step
        miss[np.searchsorted(steps, f.steps[keep])] *= 1.0 - f.probs[keep]
    return Forecast(steps, 1.0 - miss)

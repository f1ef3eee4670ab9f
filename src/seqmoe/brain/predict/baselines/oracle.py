"""An oracle forecaster: the replayed trace's true experts for the next positions, as certain rows.

For ablations (what the scheduler and the cache do with a perfect forecast) and tests. It reads the
future, so it is an oracle like `belady`: never a baseline. It does not stop at request
boundaries (the next request's routing is "known" too).

    predictor = OracleForecaster(test_trace, horizon=2 * L)
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.predict.base import Forecast, IgnoresHistory
from seqmoe.trace.schema import RoutingTrace


class OracleForecaster(IgnoresHistory):
    """Forecast one-hot rows (probability 1 for the experts really used) for `horizon` positions.

    Args:
        trace: the trace being replayed.
        horizon: H, positions forecast after the current one.
        uids: [S, L, W] global ids the replay visits, when not `trace`'s own positions (a batched
            replay: `seqmoe.sim.lockstep`).
    """

    def __init__(self, trace: RoutingTrace, horizon: int, uids: np.ndarray | None = None) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be at least 1, got {horizon}")
        ids = trace.expert_ids if uids is None else uids % trace.num_experts
        T, L, K = ids.shape
        self._ids = ids.reshape(T * L, K).astype(np.int64)  # [T*L, K] per position
        self.horizon, self.num_experts = horizon, trace.num_experts

    def predict(self, step: int) -> Forecast | None:
        lo = step + 1
        hi = min(lo + self.horizon, len(self._ids))
        if lo >= hi:
            return None
        probs = np.zeros((hi - lo, self.num_experts), dtype=np.float32)  # [H, E]
        probs[np.arange(hi - lo)[:, None], self._ids[lo:hi]] = 1.0
        return Forecast(np.arange(lo, hi, dtype=np.int64), probs)

"""affinity-style forecasting: inter-layer expert transition statistics.

Follows the idea of exploiting inter-layer expert affinity (Yao et al., "Exploiting Inter-Layer
Expert Affinity for Accelerating Mixture-of-Experts Model Inference", IPDPS 2024): the experts a
token uses at layer l make some experts at layer l+1 far more likely. From the training split we
count, for consecutive positions in execution order (layer l -> l+1 of a token, and the last layer
-> layer 0 of the next token of the same request), how often expert e' follows expert e. The
forecast for the next position averages the rows of the experts just used; further positions chain
the transition matrices (an independence approximation). Simplification: the published system uses
the affinity for expert placement across GPUs; here it drives prefetch.
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.trace.schema import RoutingTrace


def fit_transitions(train: RoutingTrace, smoothing: float = 1.0, gap: int = 1) -> np.ndarray:
    """P(e' used `gap` positions later | e used now), per layer.

    Args:
        train: training trace.
        smoothing: pseudo-count mixing in the target layer's popularity.
        gap: how many positions ahead (1: the next one).

    Returns:
        [L, E, E] float32; row (l, e) is the expected use of each expert `gap` positions after a
        layer-l position that used e; rows sum to K.
    """
    T, L, K = train.expert_ids.shape
    E = train.num_experts
    seq = train.expert_ids.reshape(T * L, K).astype(np.int64)  # positions in execution order
    same_req = np.repeat(train.request_ids(), L)
    valid = np.flatnonzero(same_req[gap:] == same_req[:-gap])  # pairs (p, p + gap) within one request
    layer = valid % L
    # Every (expert now, expert then) combination of a valid pair, as one index into [L, E, E].
    idx = (layer[:, None, None] * E + seq[valid][:, :, None]) * E + seq[valid + gap][:, None, :]
    trans = np.bincount(idx.reshape(-1), minlength=L * E * E).reshape(L, E, E).astype(np.float64)
    pop = np.bincount((np.arange(T * L) % L)[:, None].repeat(K, 1).reshape(-1) * E + seq.reshape(-1),
                      minlength=L * E).reshape(L, E) / T  # [L, E] expected use per token
    nxt_pop = np.roll(pop, -gap, axis=0)  # popularity of the target layer
    uses = trans.sum(axis=2, keepdims=True) / K  # times e was used with a successor
    return ((trans + smoothing * nxt_pop[:, None, :]) / (uses + smoothing)).astype(np.float32)


def chain_transitions(trans: np.ndarray, horizon: int) -> np.ndarray:
    """Multi-step transitions: [L, H, E, E], entry (l, h) maps use at layer l to use h+1 positions later.

    Chaining assumes the use of each expert is independent given the previous position's use.
    """
    L, E, _ = trans.shape
    K = trans[0].sum(axis=1).mean()
    out = np.empty((L, horizon, E, E), dtype=np.float32)
    for l in range(L):
        m = trans[l]
        out[l, 0] = m
        for h in range(1, horizon):
            m = (m / K) @ trans[(l + h) % L]
            out[l, h] = m
    return out


class AffinityPredictor(Predictor):
    """Forecast the next `horizon` positions from the current position's experts."""

    def __init__(self, train: RoutingTrace, horizon: int | None = None) -> None:
        self.num_layers, self.top_k = train.num_layers, train.top_k
        self.horizon = horizon or train.num_layers
        self.chain = chain_transitions(fit_transitions(train), self.horizon)  # [L, H, E, E]
        self._ids: np.ndarray | None = None  # experts used at the current position

    def begin_request(self) -> None:
        self._ids = None

    def begin_token(self, step: int, token_id: int | None) -> None:
        pass

    def observe(self, step: int, ids: np.ndarray) -> None:
        self._ids = np.asarray(ids, dtype=np.int64)

    def predict(self, step: int) -> Forecast | None:
        if self._ids is None:
            return None
        probs = self.chain[step % self.num_layers][:, self._ids].mean(axis=1)  # [H, E]
        return Forecast(np.arange(step + 1, step + 1 + self.horizon, dtype=np.int64), np.minimum(probs, 1.0))

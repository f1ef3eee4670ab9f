"""moe-infinity-style forecasting and eviction: request-level expert activation matrices.

Follows MoE-Infinity (Xue et al., "MoE-Infinity: Offloading-Efficient MoE Model Serving",
arXiv 2401.14361): each request keeps an Expert Activation Matrix (EAM, [L, E] counts of tokens
routed to each expert). Training requests' EAMs form a collection; at run time the current
request's EAM is matched by cosine similarity against the collection, and the best match's rows
give the probability of each expert at the coming layers. Prefetch priority decays with layer
distance; eviction keeps experts with a high activation ratio in the current request and close to
the current layer. Simplifications: the whole training collection is kept (no clustering into a
fixed-size EAMC) and similarity is updated incrementally per layer.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Sequence

import numpy as np

from seqmoe.brain.policies.base import EvictionPolicy
from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.trace.schema import RoutingTrace


def request_eams(trace: RoutingTrace) -> np.ndarray:
    """[R, L * E] float32: per request, the fraction of its tokens that used each (layer, expert)."""
    L, E = trace.num_layers, trace.num_experts
    R = trace.num_requests
    flat = trace.uids().reshape(trace.num_tokens, -1)  # [T, L*K]
    rows = np.repeat(trace.request_ids(), flat.shape[1])
    eam = np.zeros((R, L * E), dtype=np.float64)
    np.add.at(eam, (rows, flat.reshape(-1)), 1.0)
    return (eam / np.diff(trace.request_offsets)[:, None]).astype(np.float32)


class EAMPredictor(Predictor):
    """Match the current request's EAM against the training collection; forecast from the best."""

    def __init__(self, train: RoutingTrace, horizon: int | None = None) -> None:
        self.L, self.E, self.K = train.num_layers, train.num_experts, train.top_k
        self.collection = request_eams(train)  # [R, L*E]
        self._norms = np.linalg.norm(self.collection, axis=1) + 1e-9
        self.prior = self.collection.mean(axis=0)  # [L*E] used before any match is possible
        self.horizon = horizon or self.L
        self._lanes = [self]  # itself and its forks: the requests of a batch (`seqmoe.brain.predict.lanes`)
        self.begin_request()

    def fork(self) -> EAMPredictor:
        """A batch lane: the same collection, its own request's EAM."""
        lane = copy.copy(self)
        self._lanes.append(lane)
        lane.begin_request()
        return lane

    def batch_counts(self) -> np.ndarray:
        """[L * E] the EAMs of the batch's requests summed (MoE-Infinity keeps one matrix per request and
        prefers what the running requests use): this request's alone at batch 1."""
        return self.counts if len(self._lanes) == 1 else np.sum([p.counts for p in self._lanes], axis=0)

    def begin_request(self) -> None:
        self.counts = np.zeros(self.L * self.E, dtype=np.float32)  # the current request's EAM
        self._dots = np.zeros(len(self.collection), dtype=np.float32)
        self._best: int | None = None

    def begin_token(self, step: int, token_id: int | None) -> None:
        pass

    def observe(self, step: int, ids: np.ndarray) -> None:
        uids = (step % self.L) * self.E + np.asarray(ids, dtype=np.int64)
        self.counts[uids] += 1.0
        self._dots += self.collection[:, uids].sum(axis=1)
        self._best = int(np.argmax(self._dots / self._norms))

    def predict(self, step: int) -> Forecast | None:
        source = self.prior if self._best is None else self.collection[self._best]
        steps = np.arange(step + 1, step + 1 + self.horizon, dtype=np.int64)
        probs = source.reshape(self.L, self.E)[steps % self.L]
        return Forecast(steps, np.minimum(probs, 1.0))


class EAMPolicy(EvictionPolicy):
    """Activation-aware eviction: evict the resident expert with the lowest priority.

    priority(l, e) = (uses of e at layer l in the current request, or the batch's requests summed,
    + small prior) * (1 - d / L),
    where d = layers until layer l comes round again. Ties go to the lower uid.
    """

    def __init__(self, predictor: EAMPredictor) -> None:
        self._pred = predictor
        L, E = predictor.L, predictor.E
        self._prior = 1e-3 * predictor.prior / (predictor.prior.max() + 1e-9)
        self._layer = np.repeat(np.arange(L), E)
        self._resident = np.zeros(L * E, dtype=bool)
        self._step = 0

    def reset(self, resident: Sequence[int]) -> None:
        self._resident[:] = False
        self._resident[list(resident)] = True

    def insert(self, uid: int, step: int) -> None:
        self._resident[uid] = True
        self._step = step

    def access(self, uid: int, step: int) -> None:
        self._step = step

    def victim(self, incoming: int, pinned: Container[int]) -> int | None:
        L = self._pred.L
        d = (self._layer - self._step % L - 1) % L
        prio = (self._pred.batch_counts() + self._prior) * (1.0 - d / L)
        prio = np.where(self._resident, prio, np.inf)
        for uid in pinned:
            prio[uid] = np.inf
        uid = int(np.argmin(prio))
        return None if np.isinf(prio[uid]) else uid

    def remove(self, uid: int) -> None:
        self._resident[uid] = False

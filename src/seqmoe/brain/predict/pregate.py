"""Pre-gating and its fusion with a routing-history forecast (ExpertFlow's hybrid prediction).

A trace collected with `pregate=H` holds, for every position (t, l), the logits the routers of
layers l + 1 .. l + H give to the hidden state entering layer l (`RoutingTrace.pregate_logits`).
`PregatePredictor` forecasts those positions from them alone (softmax x K; nothing beyond the
current token). `HybridPredictor` fuses them with a history forecaster by log-linear pooling per
distance d: score = alpha_d log p_history + (1 - alpha_d) log p_pregate, alpha_d fitted on a
training trace (`fit_alphas`: the alpha of a grid that maximises recall@K at d; 1 keeps history,
0 keeps pre-gating). Where no pre-gate row exists (the next token) the history row stands.

The pre-gate rows are looked up by position, only ever the row of the position just observed
(what the hidden state entering that layer says: the present, not the future): in the trace being
replayed (offline evaluation, the simulator; `TraceRows`), or computed live from the hidden state by
the runtime (`seqmoe.runtime.eager.pregate.LivePregate`, the same numbers: `pregate_probs`). In a
batch each lane's predictor reads its own row of the step (`set_row`): a batched replay points the
trace's rows at the step's tokens (`TraceRows.tokens`, the predictor's `replay_tokens`), the
runtime's forward holds one row per sequence. The history forecaster
may be any predictor (its `forecast(step, horizon)` when it has one, else `predict(step)`).
"""

from __future__ import annotations

import warnings

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.brain.predict.base import Forecast, Predictor, topk_hits
from seqmoe.trace.schema import RoutingTrace

ALPHAS = np.linspace(0.0, 1.0, 11)
_FLOOR = 1e-6  # probabilities are floored before the log


def pregate_probs(logits: np.ndarray, top_k: int) -> np.ndarray:
    """[..., H, E] float32 probabilities x K of float16 pre-gate logits (NaN rows stay NaN: no later layer)."""
    z = logits.astype(np.float32)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():  # all-NaN rows: no later layer
        warnings.simplefilter("ignore", RuntimeWarning)
        z = z - np.nanmax(z, axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True) * top_k


def _pregate_rows(trace: RoutingTrace) -> np.ndarray:
    """[T * L, H, E] `pregate_probs` of the trace's pre-gate logits."""
    if trace.pregate_logits is None:
        raise UserError("this trace has no pre-gate scores; collect it with `seqmoe trace collect --pregate H`")
    T, L, H, E = trace.pregate_logits.shape
    return pregate_probs(trace.pregate_logits.reshape(T * L, H, E), trace.top_k)


class TraceRows:
    """The pre-gate rows of a replayed trace: `row(step, i)` of position `step` (batch 1), or, while
    `tokens` holds a batched step's trace tokens (one per row), of row i's token at step's layer."""

    def __init__(self, trace: RoutingTrace) -> None:
        self.rows, self.num_layers = _pregate_rows(trace), trace.num_layers
        self.tokens: list[int] | None = None

    def row(self, step: int, i: int = 0) -> np.ndarray:
        if self.tokens is None:
            return self.rows[step]
        return self.rows[self.tokens[i] * self.num_layers + step % self.num_layers]


class PregatePredictor(Predictor):
    """Forecast the rest of the current token from the pre-gate scores of the position just observed.

    Args:
        source: a trace with pre-gate scores, or live rows (an object with `num_layers` and
            `row(step, i)` -> [H, E] of row i of the step, as `seqmoe.runtime.eager.pregate.LivePregate`).
    """

    def __init__(self, source) -> None:
        self.pregate_source = TraceRows(source) if isinstance(source, RoutingTrace) else source
        self.replay_tokens = self.pregate_source if isinstance(source, RoutingTrace) else None
        self.L = self.pregate_source.num_layers
        self._step, self._i = None, 0

    def set_row(self, row: int) -> None:
        self._i = row

    def fork(self) -> PregatePredictor:
        """A lane's predictor: the same source (not a copy of the trace's rows or of the live model)."""
        return PregatePredictor(self.pregate_source)

    def begin_request(self) -> None:
        self._step = None

    def begin_token(self, step: int, token_id: int | None) -> None:
        pass

    def observe(self, step: int, ids: np.ndarray) -> None:
        self._step = step

    def predict(self, step: int) -> Forecast | None:
        if self._step is None:
            return None
        n = self.L - 1 - step % self.L  # later layers of this token
        rows = self.pregate_source.row(step, self._i)[:n]
        keep = ~np.isnan(rows).any(axis=1)
        return Forecast(np.arange(step + 1, step + 1 + n, dtype=np.int64)[keep], rows[keep])


class HybridPredictor(Predictor):
    """`history` fused with pre-gating per distance (see the module doc); `alphas[d - 1]` for distance d."""

    def __init__(self, history, source, alphas: np.ndarray) -> None:
        self.history, self.pregate = history, PregatePredictor(source)  # source: see `PregatePredictor`
        self.alphas = np.asarray(alphas, dtype=np.float64)
        self.pregate_source, self.replay_tokens = self.pregate.pregate_source, self.pregate.replay_tokens

    def set_row(self, row: int) -> None:
        self.pregate.set_row(row)

    def fork(self) -> HybridPredictor:
        return HybridPredictor(self.history.fork(), self.pregate_source, self.alphas)

    def begin_request(self) -> None:
        self.history.begin_request()
        self.pregate.begin_request()

    def begin_token(self, step: int, token_id: int | None) -> None:
        self.history.begin_token(step, token_id)

    def observe(self, step: int, ids: np.ndarray) -> None:
        self.history.observe(step, ids)
        self.pregate.observe(step, ids)

    def forecast(self, step: int, horizon: int) -> Forecast | None:
        hist = self.history.forecast(step, horizon)
        pre = self.pregate.predict(step)
        if hist is None or pre is None or not len(pre.steps):
            return hist
        probs = hist.probs.astype(np.float64).copy()
        for s, g in zip(pre.steps.tolist(), pre.probs):
            i, d = s - int(hist.steps[0]), s - step
            if 0 <= i < len(hist.steps) and hist.steps[i] == s and d <= len(self.alphas):
                probs[i] = fuse(probs[i], g, self.alphas[d - 1])
        return Forecast(hist.steps, probs.astype(np.float32))

    def predict(self, step: int) -> Forecast | None:
        return self.forecast(step, 2 * self.pregate.L)


def fuse(history: np.ndarray, pregate: np.ndarray, alpha: float) -> np.ndarray:
    """Log-linear pooling of two rows, rescaled to the history row's mass."""
    score = alpha * np.log(np.maximum(history, _FLOOR)) + (1 - alpha) * np.log(np.maximum(pregate, _FLOOR))
    p = np.exp(score - score.max())
    return p / p.sum() * history.sum()


def fit_alphas(history, trace: RoutingTrace, *, max_tokens: int = 3000) -> np.ndarray:
    """alpha_d per distance d = 1 .. H: the grid value with the best recall@K on `trace` (a training
    trace with pre-gate scores; its first `max_tokens` tokens, whole requests)."""
    trace = trace.head(max_tokens)
    T, L, K = trace.expert_ids.shape
    H = trace.pregate_logits.shape[2]
    rows, ids = _pregate_rows(trace), trace.expert_ids.reshape(T * L, K)
    hits = np.zeros((H, len(ALPHAS)))
    off, tokens = trace.request_offsets, trace.token_ids
    for r in range(trace.num_requests):
        history.begin_request()
        for t in range(int(off[r]), int(off[r + 1])):
            history.begin_token(t * L, None if tokens is None else int(tokens[t]))
            for l in range(L):
                step = t * L + l
                history.observe(step, ids[step])
                fc = history.forecast(step, L)
                for d in range(1, min(H, L - 1 - l, len(fc.steps)) + 1):
                    i = step + d - int(fc.steps[0])
                    g = rows[step, d - 1]
                    fused = np.stack([fuse(fc.probs[i].astype(np.float64), g, a) for a in ALPHAS])
                    hits[d - 1] += topk_hits(fused, np.broadcast_to(ids[step + d], (len(ALPHAS), K)), K)
    return ALPHAS[np.argmax(hits, axis=1)]

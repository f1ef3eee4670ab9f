"""Sequence-to-sequence expert forecasting: a GRU over routing history, run incrementally in numpy.

The network (trained by `seqmoe.brain.predict.train`; its PyTorch twin is `seqnet.SeqNet`) reads positions
(token t, layer l) in execution order, `step = t * L + l`:

- a token-level GRU: input x_t = route_in^T m_t + tok_in[b_t], where m_t is token t's full
  multi-hot routing ([L * E]) and b_t its hashed token bucket; h_t = GRU(h_{t-1}, x_t);
- a query head at (t, l_known): a = q_h h_{t-1} + q_part^T (m_t masked to layers <= l_known)
  + q_tok[b_t] + q_layer[l_known + 1]; z1 = relu(LayerNorm(a)); z = z1 + relu(mlp z1);
  logits = out z, [2, L, E]: row (0, l') forecasts token t at layer l' > l_known, row (1, l')
  forecasts token t + 1 at layer l' (direct two-token head);
- probabilities: K * softmax over E per row (rows sum to K), clipped at 1.

Further tokens come by recursion: x_hat_t mixes token t's true routing at layers <= l_known with
the forecast probabilities at the later layers, the GRU steps on it, and the query with
l_known = -1 and an unknown token forecasts two more tokens; forecasts feed back as inputs.

With a drafter (`seqmoe.brain.predict.drafters`), a token guessed with confidence c is forecast twice: as
the query at that token with the guessed bucket forecasts it (row block 0, after the GRU stepped on
x_hat of the token before), and as without the guess; its rows are c x the first + (1 - c) x the
second, and the guess enters the recursion's inputs with the same weight.

Inference is incremental and needs no torch: `observe` adds the K new rows of q_part and route_in
to running sums; the GRU steps once per token; `predict` costs one LayerNorm, one [H, H] matvec and
one matvec with the rows of `out` still ahead.

With a forecast `window` W, only the first `predict` of a token computes every row ahead; later
ones recompute the next W positions from the layers just observed, and every row further out keeps
the latest forecast that computed it (the [2L E, Z] matvec of every row dominated the decision
time). W = 0 (what the memory manager uses: `DEFAULT_WINDOW`) keeps the token's first forecast:
later `predict`s of the token return None, "no new forecast". Those calls run compiled
(`_seq_kernels`).

    pred = load_seq_predictor("results/predictor-deepseek")   # seqmoe.brain.predict.checkpoints
    pred.check_trace(test)          # L/E/K must match; binds the trace's vocabulary
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.brain.predict import _seq_kernels as kernels
from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.brain.predict.buckets import bucket_of, bucket_table
from seqmoe.trace.schema import RoutingTrace, check_dims

DEFAULT_WINDOW = 0
"""Positions re-forecast at each layer by the memory manager's forecaster (see the module doc): none,
one forecast per token; re-forecasting after each layer cost time and copies (docs/LOG.md)."""
DRAFT_DEPTH = 20
"""Tokens a drafter is asked to guess for the reference inference's recursion (`forecast`); a
forecast window reads only the next token's guess."""


class PredictorError(UserError):
    """A predictor checkpoint is missing or corrupt, or does not fit the trace."""


@dataclass(frozen=True, kw_only=True)
class SeqConfig:
    """Architecture of the sequence forecaster."""

    num_layers: int
    """L: MoE layers of the model the routing comes from."""
    num_experts: int
    """E: routed experts per layer."""
    top_k: int
    """K: experts per token and layer."""
    hash_buckets: int = 8192
    """B: token strings (or ids) are hashed with crc32 into B buckets; bucket B means unknown."""
    embed_dim: int = 256
    """D: GRU input width."""
    hidden_dim: int = 256
    """H: GRU state width."""
    query_dim: int = 256
    """Z: query head width."""
    far_head: bool = False
    """Has the long-range head (`seqmoe.brain.predict.far_head`): per token, rho^(G - 1) for every expert
    from the state; the memory manager's forecast then covers the current token only, the head the rest."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "hash_buckets", "embed_dim", "hidden_dim", "query_dim"):
            if getattr(self, name) <= 0:
                raise PredictorError(f"{name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SeqConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every weight (PyTorch layout: Linear weights are [out, in])."""
        LE, B, D, H, Z = self.num_layers * self.num_experts, self.hash_buckets, self.embed_dim, self.hidden_dim, self.query_dim
        shapes = {
            "route_in": (LE, D), "tok_in": (B + 1, D), "h0": (H,),
            "gru_w_ih": (3 * H, D), "gru_w_hh": (3 * H, H), "gru_b_ih": (3 * H,), "gru_b_hh": (3 * H,),
            "q_h_w": (Z, H), "q_h_b": (Z,), "q_part": (LE, Z), "q_tok": (B + 1, Z), "q_layer": (self.num_layers + 1, Z),
            "q_norm_w": (Z,), "q_norm_b": (Z,), "mlp_w": (Z, Z), "mlp_b": (Z,), "out_w": (2 * LE, Z), "out_b": (2 * LE,),
        }  # fmt: skip
        return shapes | ({"far_w": (LE, H), "far_b": (LE,)} if self.far_head else {})


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # tanh form: no overflow warnings for large |x|


def gru_step(w: dict, h: np.ndarray, x: np.ndarray) -> np.ndarray:
    """One GRU step with PyTorch's gate layout (r, z, n): [H] state, [D] input -> [H]."""
    H = h.shape[0]
    gi = w["gru_w_ih"] @ x + w["gru_b_ih"]
    gh = w["gru_w_hh"] @ h + w["gru_b_hh"]
    r = _sigmoid(gi[:H] + gh[:H])
    z = _sigmoid(gi[H:2 * H] + gh[H:2 * H])
    n = np.tanh(gi[2 * H:] + r * gh[2 * H:])
    return (1.0 - z) * n + z * h


def layer_probs(logits: np.ndarray, top_k: int) -> np.ndarray:
    """[N, E] float32 logits -> [N, E] float32 probabilities of use: K * softmax, clipped at 1."""
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    e *= top_k / e.sum(axis=1, keepdims=True)
    return np.minimum(e, 1.0, out=e)


class SeqPredictor(Predictor):
    """Incremental inference of the sequence forecaster; implements `Predictor`.

    Args:
        config, weights, info: the checkpoint (`load_seq_predictor`).
        window: None: every `predict` computes every row ahead (numpy, the reference); W >= 1:
            after a token's first forecast, `predict` recomputes only the next W positions (compiled);
            0: only the token's first forecast, later `predict`s return None.
    """

    def __init__(self, config: SeqConfig, weights: dict[str, np.ndarray], info: dict | None = None, *,
                 window: int | None = None) -> None:
        if window is not None and window < 0:
            raise PredictorError(f"the forecast window must be 0 or more positions, got {window}")
        self.config = config
        self.info = info or {}
        self.window = window
        if window is not None:
            kernels.warm_up()
        self.w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        self.L, self.E, self.K = config.num_layers, config.num_experts, config.top_k
        self._unknown = config.hash_buckets
        self._table: np.ndarray | None = None
        # observe() gathers both per-expert terms at once: [LE, Z + D] = [q_part | route_in].
        self._obs = np.concatenate([self.w["q_part"], self.w["route_in"]], axis=1)
        self._rows_now = np.zeros((2 * self.L, self.E), dtype=np.float32)  # window mode's latest rows
        self._offsets = np.arange(2 * self.L, dtype=np.int64)
        self._ahead = 1 if config.far_head else 2  # tokens a window-mode forecast covers
        self.far: np.ndarray | None = None
        """[L * E] float64, the long-range head's values for the current token (None without the head)."""
        self.drafter = None
        self.begin_request()

    @property
    def horizon(self) -> int:
        """Positions a `predict` covers at most: the rest of the token and the next one (2 L); with a
        forecast window and the long-range head, the rest of the token (L)."""
        return (2 if self.window is None else self._ahead) * self.L

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """New weights of the same shapes, from the next token on (the state so far is kept); the
        online learner's swap (`seqmoe.brain.predict.online`), between tokens."""
        self.w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        self._obs = np.concatenate([self.w["q_part"], self.w["route_in"]], axis=1)

    def with_window(self, window: int | None, *, far_head: bool = True) -> SeqPredictor:
        """A fresh predictor on the same weights with another forecast window (see the class), without
        the long-range head unless `far_head`."""
        if far_head or not self.config.far_head:
            return SeqPredictor(self.config, self.w, self.info, window=window)
        weights = {k: v for k, v in self.w.items() if not k.startswith("far_")}
        return SeqPredictor(dataclasses.replace(self.config, far_head=False), weights, self.info, window=window)

    def fork(self) -> SeqPredictor:
        """A fresh predictor of the same weights, window, vocabulary and drafter kind: a batch lane's
        (`seqmoe.brain.predict.lanes`)."""
        twin = SeqPredictor(self.config, self.w, self.info, window=self.window)
        twin._table = self._table
        return twin.use_drafter(None if self.drafter is None else copy.deepcopy(self.drafter))

    def set_row(self, row: int) -> None:
        if self.drafter is not None:
            self.drafter.set_row(row)

    @property
    def replay_tokens(self):
        return None if self.drafter is None else self.drafter.place

    def use_drafter(self, drafter) -> SeqPredictor:
        """Read `drafter`'s guesses of the next tokens as look-ahead (None: no drafts); returns self."""
        self.drafter = drafter
        self.begin_request()
        return self

    # -- trace binding ----------------------------------------------------------------------------
    def check_trace(self, trace: RoutingTrace) -> None:
        """Raise UserError unless `trace` has this checkpoint's L, E, K; bind its vocabulary
        (token ids passed to `begin_token` are then hashed through `trace.vocab`)."""
        check_dims("the trace", trace, self.config, "train one on a trace of the same model",
                   against="the predictor's training trace")
        self._table = bucket_table(trace, self.config.hash_buckets)

    def _bucket(self, token_id: int | None) -> int:
        return bucket_of(token_id, self._table, self.config.hash_buckets)

    # -- Predictor protocol -----------------------------------------------------------------------
    def begin_request(self) -> None:
        self._h = self.w["h0"].copy()  # [H] state after the completed tokens
        self._t: int | None = None  # current token index
        self._lk = -1  # last observed layer of the current token
        self._guess: tuple[list[int], list[float]] = ([], [])  # drafted buckets of t + 1, ... and confidences
        if self.drafter is not None:
            self.drafter.begin_request()

    def begin_token(self, step: int, token_id: int | None) -> None:
        t = step // self.L
        self._start_token(t, self._bucket(token_id))
        if self.drafter is not None:
            self.drafter.see(t, token_id)
            ids, conf = self.drafter.draft(1 if self.window is not None else DRAFT_DEPTH)
            self._guess = ([self._bucket(i) for i in ids], conf)

    def observe(self, step: int, ids: np.ndarray) -> None:
        t, l = divmod(step, self.L)
        if t != self._t:  # begin_token was skipped: the token is unknown
            self._start_token(t, self._unknown)
        if self.window is None:
            self._acc += self._obs[l * self.E + np.asarray(ids, dtype=np.int64)].sum(axis=0)
        else:
            kernels.add_rows(self._acc, self._obs, l * self.E, ids)
        self._lk = l
        self._observed = True

    def predict(self, step: int) -> Forecast | None:
        """Forecast the rest of the current token and the whole next token ([<= 2L, E]); None
        before any token, and with window 0 after the token's first forecast."""
        if self._t is None:
            return None
        if self.window is None:
            return self._direct()
        return self._windowed()

    def forecast(self, step: int, horizon: int) -> Forecast | None:
        """Forecast at least `horizon` positions after the current one, recursing past the next token."""
        if self._t is None:
            return None
        fc = self._direct()
        steps, parts = [fc.steps], [fc.probs]
        end = self._t * self.L + self._lk + horizon  # last position asked for
        if fc.steps[-1] < end:
            for s, p in self._recurse(fc.probs, end):
                steps.append(s)
                parts.append(p)
        return Forecast(np.concatenate(steps), np.concatenate(parts))

    # -- internals --------------------------------------------------------------------------------
    def _start_token(self, t: int, bucket: int) -> None:
        w = self.w
        if self._t is not None and self._observed:  # close the previous token: one GRU step
            x = self._x_acc + w["tok_in"][self._tok]
            if self.window is None:
                self._h = gru_step(w, self._h, x)
            else:
                self._h = kernels.gru_step(w["gru_w_ih"], w["gru_w_hh"], w["gru_b_ih"], w["gru_b_hh"], self._h, x)
        self._t, self._tok, self._lk = t, bucket, -1
        if "far_w" in w:
            self.far = _sigmoid((w["far_w"] @ self._h + w["far_b"]).astype(np.float64))
        if self.window is None:
            self._base = w["q_h_w"] @ self._h + w["q_h_b"] + w["q_tok"][bucket]  # [Z] fixed for the token
        else:
            self._base = kernels.token_base(w["q_h_w"], w["q_h_b"], w["q_tok"][bucket], self._h)
        Z = len(self._base)
        self._acc = np.zeros(self._obs.shape[1], dtype=np.float32)  # [Z + D] observed rows of _obs, summed
        self._q_acc, self._x_acc = self._acc[:Z], self._acc[Z:]  # views: q_part sum [Z], route_in sum [D]
        self._observed = False
        self._fresh = False  # window mode: whether `_rows_now` holds a forecast of this token yet
        self._guess = ([], [])

    def _query(self, pre: np.ndarray) -> np.ndarray:
        """[Z] pre-activation -> [Z] query vector (LayerNorm, relu, residual MLP)."""
        w = self.w
        a = pre - pre.sum() / len(pre)
        a *= 1.0 / np.sqrt(np.dot(a, a) / len(a) + 1e-5)
        z1 = np.maximum(a * w["q_norm_w"] + w["q_norm_b"], 0.0)
        return z1 + np.maximum(w["mlp_w"] @ z1 + w["mlp_b"], 0.0)

    def _rows(self, z: np.ndarray, first: int, end: int | None = None) -> np.ndarray:
        """Probabilities of output rows first..end-1 (default 2L; [end - first, E]) for query `z`."""
        E, end = self.E, 2 * self.L if end is None else end
        logits = self.w["out_w"][first * E:end * E] @ z + self.w["out_b"][first * E:end * E]
        return layer_probs(logits.reshape(-1, E), self.K)

    def _pre(self, h: np.ndarray, bucket: int) -> np.ndarray:
        """The query's pre-activation at a token's start (nothing of it routed) after state `h`."""
        w = self.w
        return w["q_h_w"] @ h + w["q_h_b"] + w["q_tok"][bucket] + w["q_layer"][0]

    def _draft_of(self, u: int) -> tuple[int, float]:
        """(bucket, confidence) of token u's guess; (unknown, 0) without one."""
        buckets, conf = self._guess
        k = u - self._t - 1
        return (buckets[k], conf[k]) if 0 <= k < len(buckets) else (self._unknown, 0.0)

    def _x_hat(self, rest_probs: np.ndarray) -> np.ndarray:
        """The GRU input of the current token: its routing so far plus the forecast of its layers ahead."""
        w, first = self.w, (self._lk + 1) * self.E
        return self._x_acc + rest_probs.reshape(-1) @ w["route_in"][first:] + w["tok_in"][self._tok]

    def _direct(self) -> Forecast:
        z = self._query(self._base + self._q_acc + self.w["q_layer"][self._lk + 1])
        first = self._lk + 1
        pos = self._t * self.L + first
        rows = self._rows(z, first)
        bucket, c = self._draft_of(self._t + 1)
        if c > 0:
            rest = self.L - first
            h = gru_step(self.w, self._h, self._x_hat(rows[:rest]))
            rows[rest:] = c * self._rows(self._query(self._pre(h, bucket)), 0, self.L) + (1 - c) * rows[rest:]
        return Forecast(np.arange(pos, pos + 2 * self.L - first, dtype=np.int64), rows)

    def _windowed(self) -> Forecast:
        """The next `window` positions forecast from the layers observed so far; the rows further out
        as their latest forecast had them (all of them at the token's first forecast)."""
        w, L, E = self.w, self.L, self.E
        first, end = self._lk + 1, self._ahead * L
        rows = self._rows_now  # [2L, E]: positions t L .. (t + 2) L - 1
        if (self._fresh and self.window == 0) or first >= end:
            return None  # the token's first forecast stands
        count = min(self.window, end - first) if self._fresh else end - first
        kernels.refresh_rows(self._base, self._q_acc, w["q_layer"][first], w["q_norm_w"], w["q_norm_b"],
                             w["mlp_w"], w["mlp_b"], w["out_w"], w["out_b"], first, count, E, self.K, rows)
        bucket, c = self._draft_of(self._t + 1)
        lo, hi = max(first, L), first + count  # the refreshed rows of the next token
        if c > 0 and hi > lo:  # mixed with its rows given the guess, from the routing seen so far
            drafted = kernels.drafted_rows(
                self._x_acc + w["tok_in"][self._tok], rows[first:L], w["route_in"], first * E,
                w["gru_w_ih"], w["gru_w_hh"], w["gru_b_ih"], w["gru_b_hh"], self._h, w["q_h_w"], w["q_h_b"],
                w["q_tok"][bucket] + w["q_layer"][0], w["q_norm_w"], w["q_norm_b"], w["mlp_w"], w["mlp_b"],
                w["out_w"], w["out_b"], L, E, self.K)
            rows[lo:hi] = c * drafted[lo - L:hi - L] + (1 - c) * rows[lo:hi]
        self._fresh = True
        return Forecast(self._t * L + self._offsets[first:end], rows[first:end].copy())

    def _recurse(self, probs: np.ndarray, end: int):
        """Yield (steps, probs) one token at a time beyond the direct forecast until `end` is covered.

        `probs` is the direct forecast: rows for the rest of token t, then token t + 1 (with its guess).
        """
        w, L = self.w, self.L
        rest = L - 1 - self._lk
        x = self._x_hat(probs[:rest])  # the GRU input of token t
        cur, u, h = probs[rest:], self._t + 1, self._h  # the forecast of token u, the token the next query is at
        while True:
            h = gru_step(w, h, x)  # the state the query at token u sees
            bucket, c = self._draft_of(u)
            guessed = self._rows(self._query(self._pre(h, bucket)), 0) if c > 0 else None  # tokens u, u + 1
            if u > self._t + 1:
                if guessed is not None:
                    cur = c * guessed[:L] + (1 - c) * cur
                yield np.arange(u * L, (u + 1) * L, dtype=np.int64), cur
                if (u + 1) * L - 1 >= end:
                    return
            nxt = self._rows(self._query(self._pre(h, self._unknown)), L)
            if guessed is not None:
                nxt = c * guessed[L:] + (1 - c) * nxt
            x = cur.reshape(-1) @ w["route_in"] + c * w["tok_in"][bucket] + (1 - c) * w["tok_in"][self._unknown]
            cur, u = nxt, u + 1

"""Synthetic routing traces from a few statistics fitted on real ones (never the traces themselves).

Model. Requests have lognormal lengths (median and clipped mean of the source). Token t at MoE
layer l picks K distinct experts by Gumbel-top-K (sampling without replacement) from the mixture

    p(e) = a_l * [e in S(t-1, l)] / K                      reuse of the previous token's experts
         + b_l * n(t, l, e) / (K * (W - 1))                 use by tokens t-2 .. t-W of the request
         + (1 - a_l - b_l) * q_l(e)
    q_l(e) ~ exp(log pop_l(e) + bias_l(e) + beta_l * sum_{i in S(t, l-1)} pmi_l(i, e))

- the copy terms give temporal locality (the previous token, and a window of W-1 before it);
  copying keeps expert frequencies and cannot lock a request onto one set;
- q_l is popularity sharpened by the inter-layer structure: pmi_l(i, e) = log P(e at l | i at
  l-1) / P(e at l), kept sparse as the top-n successors of each expert (the rest of a row shares
  one value); summing it over the token's K experts at layer l-1 concentrates q where they agree;
- bias_l corrects popularity so generated frequencies match the source's.
A copy term without history (a request's first tokens) drops out and q takes its weight.

Fit. Popularity, successors and lengths are counted. The copy weights (a, b) and the bias are
calibrated by simulation: generate a trace laid out like the source, measure token reuse, window
reuse and frequencies, take a secant step per layer, repeat (same seed every round).

beta is fixed (default 0.5), not calibrated. Matching the source's layer-to-layer predictability
(top-K of summed successor scores: 0.44 on DeepSeek-V2-Lite, 0.19 generated at beta = 0.5, 0.10
at beta = 0) needs beta around 1-2, and a first-order chain over layers that sharp compounds: consecutive tokens then
share whole paths, so reuse and popularity skew overshoot at deeper layers and no copy weight can
bring them back (calibration stops converging above beta of about 0.75). Multiplicative recency
terms (score + gamma * [used recently]) failed the same way: requests locked onto one expert set.
Real routing gets its inter-layer structure from a per-token hidden state shared by all layers,
which this model does not have.

Statistics (per layer, over tokens with a predecessor in their request):
- token reuse: mean fraction of a token's experts that the previous token also used at that
  layer (as `seqmoe.trace.stats.token_reuse_by_layer`);
- window reuse: the same against the union of the previous W tokens.

    params = load_default_params()                     # fitted on DeepSeek-V2-Lite Puffin traces
    trace = generate_trace(params, num_tokens=20_000, seed=0)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources

import numpy as np

from seqmoe.errors import UserError
from seqmoe.trace.schema import RoutingTrace, TraceMeta

DEFAULT_PARAMS_FILE = "synthetic_deepseek-v2-lite.json"
"""File in `seqmoe/data/` that `load_default_params` reads."""

_FLOOR = 1e-4  # smallest probability any expert or successor-row remainder keeps
_ARRAYS = ("popularity", "expert_bias", "successor_probs", "successor_weight", "reuse_weight",
           "window_weight", "reuse", "reuse_window")


@dataclass(frozen=True, kw_only=True, eq=False)
class SyntheticParams:
    """Statistics of a routing trace that `generate_trace` samples from (shapes: L layers, E experts).

    Attributes:
        model: model the statistics were fitted on.
        num_experts: E.
        top_k: K.
        popularity: [L, E] float64, per-layer expert frequencies of the source (rows sum to 1).
        expert_bias: [L, E] float64, additive score correction so generated frequencies match.
        successor_ids: [L-1, E, n] int64, the n most likely layer-(l+1) experts after expert i at layer l.
        successor_probs: [L-1, E, n] float64, their shares of the row (the remainder spreads by popularity).
        successor_weight: [L] float64, beta (0 at layer 0).
        reuse_weight: [L] float64, a, weight of copying the previous token's experts.
        window_weight: [L] float64, b, weight of copying experts of tokens t-2 .. t-W.
        reuse: [L] float64, token reuse of the source.
        reuse_window: [L] float64, window reuse of the source.
        window: W, tokens looked back by the window copy term and `reuse_window`.
        length_mu: log of the median request length.
        length_sigma: lognormal sigma, chosen so the clipped mean length matches the source's.
        length_max: longest request length seen (lengths are clipped to it).
        source: what the statistics were fitted on.
    """

    model: str = "unknown"
    num_experts: int
    top_k: int
    popularity: np.ndarray
    expert_bias: np.ndarray
    successor_ids: np.ndarray
    successor_probs: np.ndarray
    successor_weight: np.ndarray
    reuse_weight: np.ndarray
    window_weight: np.ndarray
    reuse: np.ndarray
    reuse_window: np.ndarray
    window: int = 8
    length_mu: float
    length_sigma: float
    length_max: int
    source: str = "unknown"

    @property
    def num_layers(self) -> int:
        """L."""
        return self.popularity.shape[0]

    def to_dict(self) -> dict:
        """JSON-serialisable dict with floats rounded to 4 decimals (the format of `from_dict`)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                v = np.round(v, 4).tolist() if v.dtype.kind == "f" else v.tolist()
            elif isinstance(v, float):
                v = round(v, 4)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: dict) -> SyntheticParams:
        """Inverse of `to_dict`."""
        d = dict(d)
        for name in _ARRAYS:
            d[name] = np.asarray(d[name], dtype=np.float64)
        d["successor_ids"] = np.asarray(d["successor_ids"], dtype=np.int64)
        return cls(**d)


def load_default_params() -> SyntheticParams:
    """Parameters fitted on DeepSeek-V2-Lite routing of Puffin prompts (see benchmarks/fit_synthetic.py)."""
    text = resources.files("seqmoe").joinpath("data", DEFAULT_PARAMS_FILE).read_text()
    return SyntheticParams.from_dict(json.loads(text))


# ---- statistics ------------------------------------------------------------------------------


def positions_in_request(offsets: np.ndarray) -> np.ndarray:
    """[T] int64 position of each token inside its request, from request offsets [R + 1]."""
    return np.arange(offsets[-1]) - np.repeat(offsets[:-1], np.diff(offsets))


def _history(ids_l: np.ndarray, positions: np.ndarray, E: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token, which experts the request's previous token used, and how many of tokens t-2..t-W did.

    Args:
        ids_l: [T, K] int, expert ids at one layer.
    Returns:
        prev: [T, E] bool; older: [T, E] float32 counts in [0, W-1].
    """
    used = np.zeros((len(ids_l), E), dtype=bool)
    np.put_along_axis(used, ids_l.astype(np.int64), True, axis=1)
    prev = np.zeros_like(used)
    prev[1:] = used[:-1] & (positions[1:, None] >= 1)
    older = np.zeros(used.shape, dtype=np.float32)
    for lag in range(2, window + 1):
        older[lag:] += used[:-lag] & (positions[lag:, None] >= lag)
    return prev, older


def reuse_per_layer(ids: np.ndarray, positions: np.ndarray, window: int = 1) -> np.ndarray:
    """[L] float64 token reuse (window=1) or window reuse (see the module docstring).

    Args:
        ids: [T, L, K] int, expert ids.
        positions: [T] int, position of each token in its request (0 = first).
        window: how many previous tokens of the request count.
    """
    T, L, K = ids.shape
    tok = positions > 0
    E = int(ids.max()) + 1
    out = np.zeros(L)
    for l in range(L):
        prev, older = _history(ids[:, l], positions, E, window)
        seen = (prev | (older > 0))[tok]
        out[l] = np.take_along_axis(seen, ids[tok, l].astype(np.int64), axis=1).mean() if tok.any() else 0.0
    return out


def _layer_frequencies(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] float64 share of each layer's activations per expert, from ids [T, L, K] (stats.layer_popularity)."""
    T, L, K = ids.shape
    uid = ids.astype(np.int64) + (np.arange(L) * num_experts)[None, :, None]
    return np.bincount(uid.ravel(), minlength=L * num_experts).reshape(L, num_experts) / (T * K)


# ---- fitting ---------------------------------------------------------------------------------


def _successors(ids: np.ndarray, E: int, n: int, pop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-n successor table [L-1, E, n] (ids, shares) from layer-pair co-occurrence per token."""
    T, L, K = ids.shape
    succ_ids = np.zeros((L - 1, E, n), dtype=np.int64)
    succ_p = np.zeros((L - 1, E, n))
    for l in range(L - 1):
        pairs = ids[:, l, :, None].astype(np.int64) * E + ids[:, l + 1, None, :]  # [T, K, K]
        co = np.bincount(pairs.ravel(), minlength=E * E).reshape(E, E).astype(np.float64)
        co[co.sum(1) == 0] = pop[l + 1]  # an expert never seen at layer l: no information
        co /= co.sum(1, keepdims=True)
        top = np.argsort(-co, axis=1, kind="stable")[:, :n]
        succ_ids[l], succ_p[l] = top, np.take_along_axis(co, top, axis=1)
    return succ_ids, succ_p


def _lognormal_lengths(lengths: np.ndarray) -> tuple[float, float]:
    """(mu, sigma) of a lognormal with the median of `lengths` and, clipped at their max, their mean."""
    mu, cap, target = float(np.log(np.median(lengths))), float(lengths.max()), float(lengths.mean())

    def clipped_mean(sigma: float) -> float:  # E[min(X, cap)] for X ~ lognormal(mu, sigma)
        z = (math.log(cap) - mu) / sigma
        phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
        return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))

    lo, hi = 1e-3, 5.0
    for _ in range(60):  # the clipped mean grows with sigma: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < target else (lo, mid)
    return mu, (lo + hi) / 2


def fit_synthetic_params(trace: RoutingTrace, *, num_successors: int = 8, successor_weight: float = 0.5,
                         window: int = 8, calibration_tokens: int = 20_000, calibration_rounds: int = 10,
                         seed: int = 0) -> SyntheticParams:
    """Fit `SyntheticParams` to a trace: count the statistics, then calibrate the weights.

    Args:
        trace: the source trace ([T, L, K] expert ids).
        num_successors: n, successors kept per expert (the JSON holds about L*E*n*2 numbers).
        successor_weight: beta, fixed (see the module docstring for why it is not calibrated).
        window: W, previous tokens seen by the window term and statistic.
        calibration_tokens: tokens generated per calibration round (laid out as the source's first requests).
        calibration_rounds: rounds of adjusting the weights.
        seed: seed of the calibration draws.
    """
    if window < 2:
        raise UserError(f"window must be at least 2 (the previous token plus older ones), got {window}")
    ids = trace.expert_ids.astype(np.int64)
    T, L, K = ids.shape
    E = trace.num_experts
    pop = (_layer_frequencies(ids, E) + _FLOOR) / (1 + E * _FLOOR)
    succ_ids, succ_p = _successors(ids, E, min(num_successors, E), pop)
    positions = positions_in_request(trace.request_offsets)
    lengths = np.diff(trace.request_offsets)
    mu, sigma = _lognormal_lengths(lengths)
    params = SyntheticParams(
        model=trace.meta.model, num_experts=E, top_k=K, popularity=pop, expert_bias=np.zeros((L, E)),
        successor_ids=succ_ids, successor_probs=succ_p,
        successor_weight=np.where(np.arange(L) > 0, successor_weight, 0.0), reuse_weight=np.full(L, 0.2),
        window_weight=np.full(L, 0.2), reuse=reuse_per_layer(ids, positions),
        reuse_window=reuse_per_layer(ids, positions, window), window=window,
        length_mu=mu, length_sigma=sigma, length_max=int(lengths.max()),
        source=f"fit_synthetic_params on {trace.meta.source} ({T} tokens, {trace.num_requests} requests)")
    n = int(np.searchsorted(trace.request_offsets, min(calibration_tokens, T), side="right")) - 1
    n_tok = int(trace.request_offsets[max(n, 1)])  # whole requests
    return _calibrate(params, positions[:n_tok], calibration_rounds, seed)


def _measure(params: SyntheticParams, positions: np.ndarray, seed: int):
    """Statistics of a trace generated at the given request positions [T].

    Returns:
        (reuse [L], window reuse [L], frequencies [L, E]).
    """
    gen = _generate_ids(params, positions, np.random.default_rng(seed))
    return (reuse_per_layer(gen, positions), reuse_per_layer(gen, positions, params.window),
            _layer_frequencies(gen, params.num_experts))


def _calibrate(params: SyntheticParams, positions: np.ndarray, rounds: int, seed: int) -> SyntheticParams:
    """Per-layer secant steps on the copy weights (a, b) and damped log-ratio steps on the bias."""
    p, prev_x, prev_got = params, None, None
    target = (params.reuse, params.reuse_window)
    slope0 = (0.6, 0.4)  # rough d(statistic)/d(weight), used until secants exist
    for _ in range(rounds):
        # Same seed every round: the statistics move only because the weights moved.
        *got, freq = _measure(p, positions, seed)
        x = (p.reuse_weight, p.window_weight)
        new = []
        for i in range(2):
            slope = np.full(len(x[i]), slope0[i])
            if prev_x is not None:
                dx = x[i] - prev_x[i]
                moved = np.abs(dx) > 1e-4
                slope = np.where(moved, (got[i] - prev_got[i]) / np.where(moved, dx, 1.0), slope0[i])
            step = (target[i] - got[i]) / np.maximum(slope, slope0[i] / 4)
            new.append(np.clip(x[i] + np.clip(step, -0.3, 0.3), 0.0, 0.98))
        shrink = np.minimum(1.0, 0.98 / np.maximum(new[0] + new[1], 1e-12))  # keep some weight on q
        bias = p.expert_bias + 0.8 * np.log((p.popularity + _FLOOR) / (freq + _FLOOR))
        prev_x, prev_got = x, got
        p = dataclasses.replace(p, reuse_weight=new[0] * shrink, window_weight=new[1] * shrink,
                                expert_bias=bias - bias.mean(1, keepdims=True))
    return p


# ---- generation ------------------------------------------------------------------------------


def _pmi_tables(params: SyntheticParams) -> np.ndarray:
    """[L, E, E] float32, pmi_l[i, e] for expert i at layer l-1; layer 0 is all zeros."""
    L, E = params.popularity.shape
    pmi = np.zeros((L, E, E), dtype=np.float32)
    for l in range(1, L):
        sid, sp, pop = params.successor_ids[l - 1], params.successor_probs[l - 1], params.popularity[l]
        rest = np.maximum(1.0 - sp.sum(1), _FLOOR)  # [E] share of the row outside the top-n
        rest_pop = np.maximum(1.0 - pop[sid].sum(1), _FLOOR)  # [E] popularity outside the top-n
        pmi[l] = np.log(rest / rest_pop)[:, None]
        np.put_along_axis(pmi[l], sid, np.log(np.maximum(sp, _FLOOR) / pop[sid]), axis=1)
    return pmi


def _sample_lengths(params: SyntheticParams, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """[R] int64 request lengths summing to exactly num_tokens (the last one cut)."""
    mean = float(np.exp(params.length_mu + params.length_sigma**2 / 2))
    parts, total = [], 0
    while total < num_tokens:
        draw = rng.lognormal(params.length_mu, params.length_sigma, size=int(num_tokens / mean) + 16)
        draw = np.clip(np.rint(draw), 1, params.length_max).astype(np.int64)
        parts.append(draw)
        total += int(draw.sum())
    lengths = np.concatenate(parts)
    ends = np.cumsum(lengths)
    r = int(np.searchsorted(ends, num_tokens))  # the request that crosses num_tokens
    lengths = lengths[: r + 1].copy()
    lengths[r] -= int(ends[r] - num_tokens)
    return lengths


def _generate_ids(params: SyntheticParams, positions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[T, L, K] int16 expert ids for tokens at the given request positions [T].

    Cell (t, l) depends on (t-1, l) and (t, l-1), so all cells on one anti-diagonal
    `position + l` (across every request) are drawn together: max_length + L vectorised steps.
    Cells are numbered c = t*L + l: the previous layer is c-1, the token j back is c - j*L.
    """
    L, E = params.popularity.shape
    K, W = params.top_k, params.window
    T = len(positions)
    base = (np.log(params.popularity) + params.expert_bias).astype(np.float32)  # [L, E]
    # beta folded in; row l*E + i holds beta_l * pmi_l[i].
    succ = (params.successor_weight[:, None, None] * _pmi_tables(params)).reshape(L * E, E).astype(np.float32)
    reuse_w = params.reuse_weight.astype(np.float32)
    window_w = params.window_weight.astype(np.float32)
    out = np.zeros((T * L, K), dtype=np.int32)
    cell_pos = np.repeat(positions, L)
    order = np.argsort(cell_pos + np.tile(np.arange(L), T), kind="stable")  # by anti-diagonal
    bounds = np.concatenate([[0], np.cumsum(np.bincount(cell_pos[order] + order % L))])
    all_l, all_pos = order % L, cell_pos[order]
    lags = np.arange(1, W + 1)
    for d in range(len(bounds) - 1):
        span = slice(bounds[d], bounds[d + 1])
        c, l, pos = order[span], all_l[span], all_pos[span]
        n = len(c)
        q = base[l]  # [n, E]
        i = np.flatnonzero(l > 0)
        if len(i):
            q[i] += np.take(succ, out[c[i] - 1] + (l[i] * E)[:, None], axis=0).sum(1)  # [n', K, E] -> [n', E]
        q -= q.max(1, keepdims=True)  # exp cannot overflow whatever beta is
        np.exp(q, out=q)
        a = np.where(pos >= 1, reuse_w[l], 0)  # [n] copy weights present for this cell
        b = np.where((pos >= 2) & (W >= 2), window_w[l], 0)
        q *= ((1 - a - b) / q.sum(1))[:, None]
        # Copy terms: (cell, lag) pairs whose lagged token is in the same request.
        cell, lag = np.nonzero(pos[:, None] >= lags)
        if len(cell):
            n_older = np.minimum(pos[cell], W) - 1  # tokens t-2 .. t-W that exist
            w = np.where(lag == 0, a[cell] / K, b[cell] / (K * np.maximum(n_older, 1)))  # [m]
            flat = (cell * E)[:, None] + out[c[cell] - (lag + 1) * L]  # [m, K]
            q += np.bincount(flat.ravel(), np.repeat(w, K), minlength=n * E).reshape(n, E)
        q /= rng.standard_exponential(q.shape, dtype=np.float32) + 1e-30  # Gumbel-top-K: no replacement
        out[c] = np.argpartition(-q, K - 1, axis=1)[:, :K]
    return out.reshape(T, L, K).astype(np.int16)


def generate_trace(params: SyntheticParams, num_tokens: int, seed: int = 0) -> RoutingTrace:
    """A synthetic trace of `num_tokens` decode tokens; the same seed gives the same trace.

    Returns:
        RoutingTrace with expert_ids [num_tokens, L, K] int16 and lognormal request lengths.
    """
    if num_tokens <= 0:
        raise UserError(f"num_tokens must be positive, got {num_tokens}")
    rng = np.random.default_rng(seed)
    lengths = _sample_lengths(params, num_tokens, rng)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = _generate_ids(params, positions_in_request(offsets), rng)
    meta = TraceMeta(model=params.model, num_experts=params.num_experts,
                     source=f"synthetic(seed={seed}) from {params.source}")
    return RoutingTrace(expert_ids=ids, request_offsets=offsets, meta=meta)

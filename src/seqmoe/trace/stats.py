"""Routing statistics of a trace: popularity skew, token-to-token reuse, layer-to-layer affinity.

Pure numpy functions of a `RoutingTrace`; `summarize(trace)` gathers them into one
JSON-serialisable dict (what `seqmoe trace info --json` prints)::

    from seqmoe.trace.io import load_trace
    from seqmoe.trace.stats import summarize
    print(summarize(load_trace("puffin.safetensors"))["token_reuse"])

Each statistic comes with the value a uniformly random router would give, to read it against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from seqmoe.trace.schema import RoutingTrace

_CHUNK = 32768  # tokens per block in the [T, ...] temporaries (memory stays ~10s of MB)


def layer_popularity(trace: RoutingTrace) -> np.ndarray:
    """Share of each layer's activations that went to each expert.

    Returns:
        [L, E] float64; row l is the fraction of layer l's T*K activations on expert e (rows sum to 1).
    """
    L, E = trace.num_layers, trace.num_experts
    counts = np.stack([np.bincount(trace.expert_ids[:, l].ravel(), minlength=E) for l in range(L)])
    return counts / (trace.num_tokens * trace.top_k)


@dataclass(frozen=True)
class PopularitySkew:
    """How unevenly each layer uses its experts.

    Attributes:
        top_share: [L] float64, share of the layer's activations taken by its `num_top` most used
            experts (uniform routing gives num_top / E).
        entropy: [L] float64, entropy of the layer's popularity divided by log(E): 1 is uniform,
            lower is more skewed.
        num_top: experts counted in `top_share`: round(top_fraction * E), at least 1.
    """

    top_share: np.ndarray
    entropy: np.ndarray
    num_top: int


def popularity_skew(trace: RoutingTrace, top_fraction: float = 0.1) -> PopularitySkew:
    """Per-layer skew of expert popularity (see `PopularitySkew`)."""
    return _skew(layer_popularity(trace), top_fraction)


def _skew(pop: np.ndarray, top_fraction: float) -> PopularitySkew:
    L, E = pop.shape
    num_top = max(1, round(top_fraction * E))
    top_share = -np.sort(-pop, axis=1)[:, :num_top].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(pop > 0, pop * np.log(pop), 0.0)
    entropy = -plogp.sum(axis=1) / math.log(E) if E > 1 else np.ones(L)
    return PopularitySkew(top_share=top_share, entropy=entropy, num_top=num_top)


def expert_masks(trace: RoutingTrace) -> np.ndarray:
    """Bit sets of the experts each token used per layer.

    Returns:
        [T, L, W] uint64 with W = ceil(E / 64); bit e % 64 of word e // 64 is set when the
        token used expert e at that layer.
    """
    T, L, _ = trace.expert_ids.shape
    W = (trace.num_experts + 63) // 64
    masks = np.zeros((T, L, W), dtype=np.uint64)
    for lo in range(0, T, _CHUNK):
        ids = trace.expert_ids[lo : lo + _CHUNK].astype(np.uint64)  # [t, L, K]
        bits = np.left_shift(np.uint64(1), ids % np.uint64(64))
        for w in range(W):
            masks[lo : lo + _CHUNK, :, w] = np.bitwise_or.reduce(np.where(ids // 64 == w, bits, 0), axis=2)
    return masks


def _popcount(x: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(x)
    table = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
    return table[x.view(np.uint8)].reshape(*x.shape, 8).sum(axis=-1)


def token_reuse_by_layer(trace: RoutingTrace) -> np.ndarray:
    """Per layer, the mean share of a token's experts that the previous token also used.

    Averages |experts(t, l) & experts(t-1, l)| / K over tokens t whose previous token is in the
    same request. A uniformly random router gives K / E (`random_reuse`).

    Returns:
        [L] float64; NaN when no request has two tokens.
    """
    masks = expert_masks(trace)  # [T, L, W]
    rid = trace.request_ids()
    same = rid[1:] == rid[:-1]  # [T-1] pairs (t-1, t) inside one request
    if not same.any():
        return np.full(trace.num_layers, np.nan)
    shared = _popcount(masks[1:][same] & masks[:-1][same]).sum(axis=2)  # [P, L]
    return shared.mean(axis=0) / trace.top_k


def token_reuse(trace: RoutingTrace) -> float:
    """Mean of `token_reuse_by_layer` over layers (each layer has the same number of pairs)."""
    return float(np.mean(token_reuse_by_layer(trace)))


def random_reuse(trace: RoutingTrace) -> float:
    """K / E: the expected share of experts two independent uniform random top-K picks share."""
    return trace.top_k / trace.num_experts


def layer_affinity_by_layer(trace: RoutingTrace, max_tokens: int | None = 20_000) -> np.ndarray:
    """How well a token's experts at layer l predict its experts at layer l + 1.

    Definition: count C_l[a, b] = number of tokens that used expert a at layer l and expert b at
    layer l + 1 (over the whole trace). For a token, score every expert b at l + 1 by
    sum over its experts a at layer l of C_l[a, b], take the K best (ties to the lower id), and
    count how many of the token's real experts at l + 1 are among them. Returns that count / K,
    averaged over tokens. The counts include the token itself (in-sample), so this is what a
    first-order "successor table" predictor could reach when trained on this very trace.
    Compare with `popular_affinity` (always guess layer l+1's K most used experts) and K / E.

    Args:
        trace: the trace.
        max_tokens: score at most this many tokens, evenly spaced over the trace (the counts
            always use every token); None scores all. Ranking costs O(T x E) per layer pair,
            and 20k tokens pin the mean down to well under 0.01.

    Returns:
        [L - 1] float64 (empty when L = 1).
    """
    T, L, K = trace.expert_ids.shape
    E = trace.num_experts
    if max_tokens is None or T <= max_tokens:
        sample = np.arange(T)
    else:
        sample = np.linspace(0, T - 1, max_tokens).astype(np.int64)  # evenly spaced, distinct
    tiebreak = np.arange(E - 1, -1, -1)  # lower id wins among equal scores
    rows = np.arange(len(sample))[:, None]
    out = np.zeros(L - 1)
    for l in range(L - 1):
        cur = trace.expert_ids[:, l].astype(np.int64)  # [T, K]
        nxt = trace.expert_ids[:, l + 1].astype(np.int64)
        pairs = cur[:, :, None] * E + nxt[:, None, :]  # [T, K, K]
        counts = np.bincount(pairs.ravel(), minlength=E * E).reshape(E, E)
        score = counts[cur[sample]].sum(axis=1)  # [S, E]: sum of the rows of the token's experts
        top = np.argpartition(-(score * E + tiebreak), K - 1, axis=1)[:, :K]  # [S, K]
        chosen = np.zeros((len(sample), E), dtype=bool)
        chosen[rows, top] = True
        out[l] = chosen[rows, nxt[sample]].sum() / (len(sample) * K)
    return out


def layer_affinity(trace: RoutingTrace) -> float:
    """Mean of `layer_affinity_by_layer` over layer pairs; NaN when L = 1."""
    by_layer = layer_affinity_by_layer(trace)
    return float(by_layer.mean()) if len(by_layer) else math.nan


def popular_affinity(trace: RoutingTrace) -> float:
    """Baseline for `layer_affinity`: guess layer l+1's K most used experts for every token.

    Returns:
        The mean over l >= 1 of the popularity share of layer l's top K experts; NaN when L = 1.
    """
    return _popular_affinity(layer_popularity(trace), trace.top_k)


def _popular_affinity(pop: np.ndarray, top_k: int) -> float:
    if len(pop) < 2:
        return math.nan
    pop = pop[1:]  # [L - 1, E]
    top = np.argsort(-pop, axis=1, kind="stable")[:, :top_k]
    return float(np.take_along_axis(pop, top, axis=1).sum(axis=1).mean())


def summarize(trace: RoutingTrace) -> dict:
    """All statistics of `trace` as one JSON-serialisable dict (NaN becomes None)."""
    pop = layer_popularity(trace)
    skew = _skew(pop, 0.1)
    reuse_by_layer = token_reuse_by_layer(trace)
    affinity_by_layer = layer_affinity_by_layer(trace)
    lengths = np.diff(trace.request_offsets)
    return {
        "model": trace.meta.model,
        "source": trace.meta.source,
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "num_tokens": trace.num_tokens,
        "num_requests": trace.num_requests,
        "request_tokens_min": int(lengths.min()),
        "request_tokens_median": float(np.median(lengths)),
        "request_tokens_max": int(lengths.max()),
        "has_gate_weights": trace.gate_weights is not None,
        "has_token_ids": trace.token_ids is not None,
        "token_reuse": _num(np.mean(reuse_by_layer)),
        "token_reuse_random": _num(random_reuse(trace)),
        "token_reuse_by_layer": [_num(x) for x in reuse_by_layer],
        "skew_num_top": skew.num_top,
        "skew_top_share": [_num(x) for x in skew.top_share],
        "skew_top_share_uniform": _num(skew.num_top / trace.num_experts),
        "skew_entropy": [_num(x) for x in skew.entropy],
        "layer_affinity": _num(affinity_by_layer.mean()) if len(affinity_by_layer) else None,
        "layer_affinity_by_layer": [_num(x) for x in affinity_by_layer],
        "layer_affinity_popular": _num(_popular_affinity(pop, trace.top_k)),
        "layer_affinity_random": _num(random_reuse(trace)),
    }


def _num(x: float) -> float | None:
    x = float(x)
    return None if math.isnan(x) else round(x, 6)

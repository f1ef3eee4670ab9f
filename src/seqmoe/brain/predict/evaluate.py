"""Forecast quality per horizon: precision and recall at K of any `Predictor` on a trace.

Each predictor replays the trace in decode order exactly as the simulator drives it
(`begin_request`, `begin_token`, `observe`). After observing position p (p = t * L + l), its
forecast row for position p + h is ranked; with the true K experts of p + h:

- recall@K = precision@K = |top-K of the row  ∩  true experts| / K (both sets have K members);
- recall@2K = |top-2K of the row  ∩  true experts| / K;
- recall@C = |top-C of the row  ∩  true experts| / K for a cache of C experts per layer, and stalls per
  token = L x K x (1 - recall@C) (the definitions of public routing-trace datasets such as commitmoe's);
- MoE-Beyond's (arXiv 2508.17137) classification metrics of the top-K set as a E-way multi-hot row:
  element accuracy (the share of the E labels right) and macro-F1 (F1 of each expert over all rows,
  averaged over the E experts; an expert never routed nor predicted scores 0, as sklearn's default).

Only targets inside the request of position p are scored (a predictor cannot know the next
request; it is reset at request starts). A target the forecast does not cover scores 0 and is
counted in `uncovered`. Predictors with a `forecast(step, horizon)` method (the sequence model)
are asked for the largest horizon; the others are asked `predict(step)`.

    results = evaluate_predictors(test, {"freq": FrequencyPredictor(train), ...})
    print(format_table(results)); plot_recall(results, "recall.png")
"""

from __future__ import annotations

import os
import time

import numpy as np
from tqdm import tqdm

from seqmoe.base.files import atomic_path
from seqmoe.brain.predict.base import Predictor, topk_hits
from seqmoe.trace.schema import RoutingTrace

BASE_HORIZONS = (1, 2, 4, 8, 13)
FAR_TOKENS = (5, 10, 20)
_CHUNK = 8192  # rows scored at once


def default_horizons(num_layers: int, tokens: int = 2) -> tuple[int, ...]:
    """1, 2, 4, 8, 13 layers ahead (those below 2L), one token (L) and two tokens (2L) ahead, and
    5, 10 and 20 tokens ahead up to `tokens`."""
    hs = {h for h in BASE_HORIZONS if h < 2 * num_layers} | {num_layers, 2 * num_layers}
    hs |= {k * num_layers for k in FAR_TOKENS if k <= tokens}
    return tuple(sorted(hs))


class _Scorer:
    """Accumulates (horizon, forecast row, truth) triples and scores them in chunks."""

    def __init__(self, horizons, num_experts: int, top_k: int, cache_size: int) -> None:
        self.H, self.E, self.K, self.C = len(horizons), num_experts, top_k, cache_size
        self.rows = np.zeros((_CHUNK, num_experts), dtype=np.float32)
        self.truth = np.zeros((_CHUNK, top_k), dtype=np.int64)
        self.hid = np.zeros(_CHUNK, dtype=np.int64)
        self.n = 0
        self.hits_k = np.zeros(self.H, dtype=np.int64)
        self.hits_2k = np.zeros(self.H, dtype=np.int64)
        self.count = np.zeros(self.H, dtype=np.int64)
        self.uncovered = np.zeros(self.H, dtype=np.int64)
        self.hits_c = np.zeros(self.H, dtype=np.int64)
        self.right = np.zeros(self.H, dtype=np.int64)  # multi-hot labels right
        self.tp, self.fp, self.fn = (np.zeros((self.H, num_experts), dtype=np.int64) for _ in range(3))

    def add(self, h: int, row: np.ndarray | None, truth: np.ndarray) -> None:
        self.count[h] += 1
        if row is None:  # predicts nothing: every routed expert is a false negative
            self.uncovered[h] += 1
            self.fn[h, truth] += 1
            self.right[h] += self.E - self.K
            return
        self.rows[self.n], self.truth[self.n], self.hid[self.n] = row, truth, h
        self.n += 1
        if self.n == _CHUNK:
            self.flush()

    def flush(self) -> None:
        n, K = self.n, self.K
        if n:
            hid = self.hid[:n]
            for hits, k in ((self.hits_k, K), (self.hits_2k, 2 * K)):
                got = topk_hits(self.rows[:n], self.truth[:n], k)
                hits += np.bincount(hid, got, minlength=self.H).astype(np.int64)
            self.hits_c += np.bincount(hid, topk_hits(self.rows[:n], self.truth[:n], self.C), minlength=self.H
                                       ).astype(np.int64)
            self._classify(n, hid)
        self.n = 0

    def _classify(self, n: int, hid: np.ndarray) -> None:
        """MoE-Beyond's counts: the row's top-K as a multi-hot prediction against the true multi-hot."""
        rows = np.arange(n)[:, None]
        pred = np.zeros((n, self.E), dtype=bool)
        pred[rows, np.argpartition(-self.rows[:n], self.K - 1, axis=1)[:, :self.K]] = True
        true = np.zeros((n, self.E), dtype=bool)
        true[rows, self.truth[:n]] = True
        self.right += np.bincount(hid, (pred == true).sum(1), minlength=self.H).astype(np.int64)
        for counts, hot in ((self.tp, pred & true), (self.fp, pred & ~true), (self.fn, ~pred & true)):
            np.add.at(counts, hid, hot.astype(np.int64))

    def result(self, horizons, num_layers: int) -> dict:
        self.flush()
        denom = np.maximum(self.count, 1) * self.K

        def per_h(values):
            return {int(h): float(v) for h, v in zip(horizons, values)}

        return {
            "recall_at_k": {int(h): float(v) for h, v in zip(horizons, self.hits_k / denom)},
            "recall_at_2k": {int(h): float(v) for h, v in zip(horizons, self.hits_2k / denom)},
            "targets": {int(h): int(v) for h, v in zip(horizons, self.count)},
            "uncovered": {int(h): int(v) for h, v in zip(horizons, self.uncovered)},
            "cache_size": self.C,
            "recall_at_c": per_h(self.hits_c / denom),
            "stalls_per_token": per_h(num_layers * self.K * (1 - self.hits_c / denom)),
            "accuracy": per_h(self.right / (np.maximum(self.count, 1) * self.E)),
            "macro_f1": per_h(macro_f1(self.tp, self.fp, self.fn)),
        }


def macro_f1(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """[..., E] counts -> [...] F1 averaged over the last axis (an expert with no positives scores 0)."""
    denom = 2 * tp + fp + fn
    return np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0).mean(-1)


def _score_position(scorer: _Scorer, fc, step: int, horizons, req_end_step: int, ids_flat: np.ndarray) -> None:
    """Score the forecast made after `step` against every horizon whose target is in the request."""
    for hi, h in enumerate(horizons):
        target = step + h
        if target >= req_end_step:
            continue
        row = None
        if fc is not None and len(fc.steps):
            i = target - int(fc.steps[0])  # steps are usually contiguous; check before trusting it
            if not (0 <= i < len(fc.steps) and fc.steps[i] == target):
                i = int(np.searchsorted(fc.steps, target))
            if i < len(fc.steps) and fc.steps[i] == target:
                row = fc.probs[i]
        scorer.add(hi, row, ids_flat[target])


def evaluate_predictor(trace: RoutingTrace, predictor: Predictor, *, horizons=None, stride: int = 1,
                       progress: bool = False, desc: str = "", cache_size: int | None = None) -> dict:
    """Replay `trace` through `predictor` and score its forecasts per horizon.

    Args:
        trace: the test trace ([T, L, K] expert ids).
        predictor: any `Predictor`; it must forecast at least max(horizons) positions ahead to
            score at every horizon (uncovered targets score 0).
        horizons: positions ahead to score (default: `default_horizons(L)`).
        stride: score only positions with `step % stride == 0` (every position still observed).
        progress: show a progress bar.
        desc: progress-bar label.
        cache_size: C of recall@C and stalls per token, experts per layer (default: 2K).

    Returns:
        {"recall_at_k", "recall_at_2k", "recall_at_c", "stalls_per_token", "accuracy", "macro_f1", "targets",
        "uncovered"}: dicts keyed by horizon, plus "cache_size" and
        "us_per_layer", the mean replay time (begin_token + observe + forecast) per position.
    """
    T, L, K = trace.expert_ids.shape
    horizons = tuple(horizons or default_horizons(L))
    hmax = max(horizons)
    ids_flat = trace.expert_ids.reshape(T * L, K)
    tokens = trace.token_ids.tolist() if trace.token_ids is not None else [None] * T
    off = trace.request_offsets
    scorer = _Scorer(horizons, trace.num_experts, K, 2 * K if cache_size is None else cache_size)
    spent = 0.0
    for r in tqdm(range(trace.num_requests), disable=not progress, desc=desc, unit="req", leave=False):
        req_end_step = int(off[r + 1]) * L
        t0 = time.perf_counter()
        predictor.begin_request()
        spent += time.perf_counter() - t0
        for t in range(int(off[r]), int(off[r + 1])):
            t0 = time.perf_counter()
            predictor.begin_token(t * L, tokens[t])
            spent += time.perf_counter() - t0
            for l in range(L):
                step = t * L + l
                t0 = time.perf_counter()
                predictor.observe(step, ids_flat[step])
                fc = predictor.forecast(step, hmax) if step % stride == 0 else None
                spent += time.perf_counter() - t0
                if step % stride == 0:
                    _score_position(scorer, fc, step, horizons, req_end_step, ids_flat)
    out = scorer.result(horizons, L)
    out["us_per_layer"] = 1e6 * spent / (T * L)
    return out


def time_predictor(trace: RoutingTrace, predictor: Predictor, num_tokens: int = 500) -> dict:
    """Host time of the calls the simulator makes, on the first `num_tokens` tokens of `trace`.

    Per token: `begin_token` + `predict` (token known, nothing routed), then per layer `observe` +
    `predict`. Returns {"us_per_layer", "us_per_token", "tokens"}.
    """
    T, L, K = trace.expert_ids.shape
    n = min(num_tokens, T)
    ids = trace.expert_ids.reshape(T * L, K)
    tokens = trace.token_ids.tolist() if trace.token_ids is not None else [None] * T
    starts = set(trace.request_offsets[:-1].tolist())
    t0 = time.perf_counter()
    for t in range(n):
        if t in starts:
            predictor.begin_request()
        predictor.begin_token(t * L, tokens[t])
        predictor.predict(t * L - 1)
        for step in range(t * L, (t + 1) * L):
            predictor.observe(step, ids[step])
            predictor.predict(step)
    spent = time.perf_counter() - t0
    return {"us_per_layer": 1e6 * spent / (n * L), "us_per_token": 1e6 * spent / n, "tokens": n}


def evaluate_predictors(trace: RoutingTrace, predictors: dict, *, horizons=None, stride: int = 1,
                        progress: bool = False, cache_size: int | None = None) -> dict:
    """`evaluate_predictor` and `time_predictor` for each named predictor.

    Returns:
        {"horizons", "stride", "top_k", "num_layers", "num_tokens", "predictors": {name: result}}, each
        result as from `evaluate_predictor` plus "decision" (simulator-path timing).
    """
    horizons = tuple(horizons or default_horizons(trace.num_layers))
    res = {}
    for name, p in predictors.items():
        res[name] = evaluate_predictor(trace, p, horizons=horizons, stride=stride, progress=progress, desc=name,
                                       cache_size=cache_size)
        res[name]["decision"] = time_predictor(trace, p)
    return {"horizons": list(horizons), "stride": stride, "top_k": trace.top_k, "num_layers": trace.num_layers,
            "num_tokens": trace.num_tokens, "predictors": res}


def format_table(results: dict, metric: str = "recall_at_k") -> str:
    """A text table: one row per predictor, one column per horizon."""
    hs = results["horizons"]
    L = results.get("num_layers")
    names = {h: ("L" if h == L else f"{h // L}L" if L and h > L and h % L == 0 else str(h)) for h in hs}
    width = max([len("predictor")] + [len(n) for n in results["predictors"]])
    head = f"{'predictor':<{width}}  " + "  ".join(f"{'h=' + names[h]:>6}" for h in hs)
    lines = [f"{metric} by horizon (positions ahead)", head]
    for name, res in results["predictors"].items():
        # "-": the predictor forecasts no row that far
        lines.append(f"{name:<{width}}  " + "  ".join(
            f"{res[metric][h]:>6.3f}" if res["uncovered"][h] < res["targets"][h] else f"{'-':>6}" for h in hs))
    return "\n".join(lines)


def plot_recall(results: dict, path: str | os.PathLike, caption: str | None = None) -> None:
    """Write a PNG of recall@K (solid) and recall@2K (dashed) against horizon, one colour per predictor."""
    import matplotlib  # matplotlib: only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when this runs

    hs = results["horizons"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, res) in enumerate(results["predictors"].items()):
        colour = f"C{i}"
        ax.plot(hs, [res["recall_at_k"][h] for h in hs], "o-", color=colour, label=f"{name} @K")
        ax.plot(hs, [res["recall_at_2k"][h] for h in hs], "x--", color=colour, alpha=0.6, label=f"{name} @2K")
    ax.set_xscale("log", base=2)
    ax.set_xticks(hs, [str(h) for h in hs])
    ax.set_xlabel("horizon (positions ahead; one token = L positions)")
    ax.set_ylabel("recall")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=6, family="monospace")
    fig.tight_layout(rect=(0, 0.04 if caption else 0, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def predicted_sets(trace: RoutingTrace, predictor: Predictor, *, distance: int, k: int | None = None,
                   fallback: np.ndarray | None = None, request_mix: float = 0.0) -> np.ndarray:
    """[T, L, k] int64: for each position, the top-k experts of the forecast `predictor` made `distance`
    positions before it, after observing that position (causal; replayed as `evaluate_predictor` does), as
    predictions for `seqmoe.brain.predict.baselines.external` to replay (default k: the trace's K).

    Positions with no forecast that far back in their request take `fallback` ([L, k] ids, e.g. the
    training split's most used per layer; default: experts 0..k-1). `request_mix` in [0, 1): each row
    mixed with the request's own routing so far at that layer (its use counts, normalised to K), a
    causal lever on the prompt's own history."""
    T, L, K = trace.expert_ids.shape
    k = K if k is None else k
    ids_flat = trace.expert_ids.reshape(T * L, K).astype(np.int64)
    out = np.broadcast_to(np.arange(k) if fallback is None else fallback, (T, L, k)).reshape(T * L, k).copy()
    tokens = trace.token_ids.tolist() if trace.token_ids is not None else [None] * T
    off = trace.request_offsets
    for r in range(trace.num_requests):
        predictor.begin_request()
        counts = np.zeros((L, trace.num_experts))
        end = int(off[r + 1]) * L
        for t in range(int(off[r]), int(off[r + 1])):
            predictor.begin_token(t * L, tokens[t])
            for layer in range(L):
                step = t * L + layer
                predictor.observe(step, ids_flat[step])
                counts[layer, ids_flat[step]] += 1
                target = step + distance
                fc = predictor.forecast(step, distance) if target < end else None
                if fc is None or not len(fc.steps):
                    continue
                i = int(np.searchsorted(fc.steps, target))
                if i < len(fc.steps) and fc.steps[i] == target:
                    row = fc.probs[i].astype(np.float64)
                    seen = counts[target % L]
                    if request_mix and seen.sum():
                        row = (1 - request_mix) * row + request_mix * K * seen / seen.sum()
                    out[target] = np.argpartition(-row, k - 1)[:k]
    return out.reshape(T, L, k)

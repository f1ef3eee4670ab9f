"""Trace statistics: hand-computed examples, naive reference twins, properties.

Run: .venv/bin/pytest tests/trace/test_stats.py -q
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqmoe.trace.schema import RoutingTrace, TraceMeta
from seqmoe.trace.stats import (
    expert_masks,
    layer_affinity,
    layer_affinity_by_layer,
    layer_popularity,
    popular_affinity,
    popularity_skew,
    random_reuse,
    summarize,
    token_reuse,
    token_reuse_by_layer,
)


def make(ids, offsets=None, E=4) -> RoutingTrace:
    ids = np.asarray(ids, dtype=np.int16)
    offsets = [0, len(ids)] if offsets is None else offsets
    offsets = np.array(offsets, dtype=np.int64)
    return RoutingTrace(expert_ids=ids, request_offsets=offsets, meta=TraceMeta(num_experts=E))


# [T=3, L=2, K=2], E=4: worked through by hand in the tests below.
HAND = [[[0, 1], [2, 3]], [[1, 2], [3, 2]], [[1, 0], [0, 2]]]


def test_popularity_by_hand():
    pop = layer_popularity(make(HAND))
    np.testing.assert_allclose(pop, [[2 / 6, 3 / 6, 1 / 6, 0], [1 / 6, 0, 3 / 6, 2 / 6]])


def test_skew_by_hand():
    skew = popularity_skew(make(HAND))  # 10% of 4 experts rounds to 0: at least 1
    assert skew.num_top == 1
    np.testing.assert_allclose(skew.top_share, [0.5, 0.5])
    h = -sum(p * math.log(p) for p in (1 / 3, 1 / 2, 1 / 6)) / math.log(4)
    np.testing.assert_allclose(skew.entropy, [h, h])
    uniform = popularity_skew(make([[[0, 1]], [[2, 3]]]), top_fraction=0.5)
    np.testing.assert_allclose(uniform.entropy, [1.0])
    np.testing.assert_allclose(uniform.top_share, [0.5])


def test_reuse_by_hand():
    # layer 0: {0,1}->{1,2} shares 1, {1,2}->{0,1} shares 1; layer 1: {2,3}->{2,3} 2, ->{0,2} 1.
    np.testing.assert_allclose(token_reuse_by_layer(make(HAND)), [0.5, 0.75])
    assert token_reuse(make(HAND)) == pytest.approx(0.625)
    # A request boundary between tokens 0 and 1 removes that pair.
    np.testing.assert_allclose(token_reuse_by_layer(make(HAND, [0, 1, 3])), [0.5, 0.5])
    assert random_reuse(make(HAND)) == 0.5


def test_reuse_of_repeating_trace_is_one():
    ids = np.tile(np.array([[3, 1, 7], [0, 5, 2]]), (10, 1, 1))  # [T=10, L=2, K=3]
    trace = make(ids, [0, 4, 10], E=8)
    assert token_reuse(trace) == 1.0
    assert layer_affinity(trace) == 1.0


def test_reuse_nan_without_pairs():
    trace = make(HAND, [0, 1, 2, 3])
    assert np.isnan(token_reuse_by_layer(trace)).all()
    assert summarize(trace)["token_reuse"] is None


def test_affinity_by_hand():
    # C[a, b] over tokens (layer 0 -> 1): rows C[0] = [1,0,2,1], C[1] = [1,0,3,2], C[2] = [0,0,1,1].
    # Token 0 and 2 (experts {0,1}) score [2,0,5,3], token 1 ({1,2}) scores [1,0,4,3]: all
    # guess {2,3}; real sets {2,3}, {3,2}, {0,2} give 2 + 2 + 1 hits of 6.
    np.testing.assert_allclose(layer_affinity_by_layer(make(HAND)), [5 / 6])
    assert popular_affinity(make(HAND)) == pytest.approx(3 / 6 + 2 / 6)


def test_affinity_ties_go_to_lower_id():
    # Expert 0 at layer 0 leads to 1 and 2 once each: the tie picks 1, so token 1 (real 2) misses.
    trace = make([[[0], [1]], [[0], [2]]], E=4)
    np.testing.assert_allclose(layer_affinity_by_layer(trace), [0.5])


def test_single_layer_has_no_affinity():
    trace = make([[[0, 1]], [[1, 2]]])
    assert layer_affinity_by_layer(trace).shape == (0,)
    assert math.isnan(layer_affinity(trace)) and math.isnan(popular_affinity(trace))
    assert summarize(trace)["layer_affinity"] is None


def test_expert_masks_multiword():
    trace = make([[[0, 64, 127]]], E=130)
    masks = expert_masks(trace)
    assert masks.shape == (1, 1, 3)
    assert masks[0, 0].tolist() == [1, 1 | (1 << 63), 0]


# ----------------------------------------------------------------------------- properties


def naive_reuse(trace: RoutingTrace) -> np.ndarray:
    rid = trace.request_ids()
    per_layer = [[] for _ in range(trace.num_layers)]
    for t in range(1, trace.num_tokens):
        if rid[t] == rid[t - 1]:
            for l in range(trace.num_layers):
                shared = set(trace.expert_ids[t, l].tolist()) & set(trace.expert_ids[t - 1, l].tolist())
                per_layer[l].append(len(shared) / trace.top_k)
    return np.array([np.mean(x) if x else np.nan for x in per_layer])


def naive_affinity(trace: RoutingTrace) -> np.ndarray:
    ids, E, K = trace.expert_ids.tolist(), trace.num_experts, trace.top_k
    out = []
    for l in range(trace.num_layers - 1):
        counts = np.zeros((E, E), dtype=np.int64)
        for tok in ids:
            for a in tok[l]:
                for b in tok[l + 1]:
                    counts[a, b] += 1
        hits = 0
        for tok in ids:
            score = counts[tok[l]].sum(axis=0)
            guess = sorted(range(E), key=lambda b: (-score[b], b))[:K]
            hits += len(set(guess) & set(tok[l + 1]))
        out.append(hits / (len(ids) * K))
    return np.array(out)


@st.composite
def traces(draw):
    E = draw(st.integers(1, 130))
    K = draw(st.integers(1, min(E, 4)))
    T, L = draw(st.integers(1, 12)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pool = rng.permutation(E)[: max(K, draw(st.integers(1, E)))]  # few experts: more repeats
    ids = np.array([[rng.choice(pool, K, replace=False) for _ in range(L)] for _ in range(T)])
    cuts = sorted(draw(st.sets(st.integers(1, T - 1), max_size=3))) if T > 1 else []
    return make(ids, [0, *cuts, T], E=E)


@settings(max_examples=150, deadline=None)
@given(trace=traces())
def test_statistics_properties(trace):
    reuse = token_reuse_by_layer(trace)
    np.testing.assert_allclose(reuse, naive_reuse(trace), equal_nan=True)
    assert np.all(np.isnan(reuse) | ((reuse >= 0) & (reuse <= 1)))
    affinity = layer_affinity_by_layer(trace)
    np.testing.assert_allclose(affinity, naive_affinity(trace))
    assert np.all((affinity >= 0) & (affinity <= 1))
    pop = layer_popularity(trace)
    np.testing.assert_allclose(pop.sum(axis=1), 1.0)
    skew = popularity_skew(trace)
    assert np.all((skew.entropy >= -1e-12) & (skew.entropy <= 1 + 1e-12))
    assert np.all(skew.top_share <= 1 + 1e-12) and np.all(skew.top_share >= skew.num_top / trace.num_experts - 1e-12)


def test_affinity_sampling_close_to_exact():
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((3000, 3, 16)), axis=2)[:, :, :2]
    ids[:, 1, 0] = ids[:, 0, 0]  # some structure, so the table predictor beats chance
    ids[:, 1, 1] = np.where(ids[:, 1, 1] == ids[:, 1, 0], (ids[:, 1, 0] + 1) % 16, ids[:, 1, 1])
    trace = make(ids, E=16)
    exact = layer_affinity_by_layer(trace, max_tokens=None)
    np.testing.assert_allclose(layer_affinity_by_layer(trace, max_tokens=1000), exact, atol=0.05)


def test_summarize_is_json():
    s = summarize(make(HAND, [0, 2, 3]))
    line = json.dumps(s, allow_nan=False)
    assert json.loads(line) == s
    keys = "num_layers num_experts top_k num_tokens num_requests token_reuse token_reuse_random"
    keys += " skew_top_share skew_entropy layer_affinity model source"
    assert set(keys.split()) <= set(s)
    assert (s["num_layers"], s["num_experts"], s["top_k"], s["num_tokens"], s["num_requests"]) == (2, 4, 2, 3, 2)
    assert len(s["skew_top_share"]) == len(s["skew_entropy"]) == len(s["token_reuse_by_layer"]) == 2

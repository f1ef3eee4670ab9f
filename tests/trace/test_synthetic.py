"""Synthetic traces: determinism, validity, fitted statistics carried over, the shipped parameters.

Run: .venv/bin/pytest tests/trace/test_synthetic.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqmoe.errors import UserError
from seqmoe.trace import stats
from seqmoe.trace.synthetic import (
    SyntheticParams,
    fit_synthetic_params,
    generate_trace,
    load_default_params,
    positions_in_request,
    reuse_per_layer,
)
from tests.conftest import make_trace


@pytest.fixture(scope="module")
def source():
    """A small source with skewed popularity and token-to-token reuse (L=4, E=16, K=2)."""
    return make_trace(num_tokens=3000, num_layers=4, num_experts=16, top_k=2, num_requests=40, seed=3, reuse=0.4)


@pytest.fixture(scope="module")
def fitted(source):
    return fit_synthetic_params(source, num_successors=4, calibration_tokens=3000, seed=0)


@pytest.fixture(scope="module")
def default_params():
    return load_default_params()


def test_same_seed_same_trace(fitted):
    a, b, c = (generate_trace(fitted, 500, seed=s) for s in (7, 7, 8))
    assert np.array_equal(a.expert_ids, b.expert_ids) and np.array_equal(a.request_offsets, b.request_offsets)
    assert not np.array_equal(a.expert_ids, c.expert_ids)


def test_shapes_and_validity(fitted, source):
    t = generate_trace(fitted, 777, seed=1)  # RoutingTrace validates ids, distinctness and offsets
    assert t.expert_ids.shape == (777, source.num_layers, source.top_k) and t.expert_ids.dtype == np.int16
    assert t.num_experts == source.num_experts and t.request_offsets[-1] == 777
    assert np.diff(t.request_offsets).max() <= fitted.length_max
    with pytest.raises(UserError, match="num_tokens"):
        generate_trace(fitted, 0)


def test_reuse_matches_the_project_definition(source):
    pos = positions_in_request(source.request_offsets)
    np.testing.assert_allclose(reuse_per_layer(source.expert_ids, pos), stats.token_reuse_by_layer(source))
    # A window of W tokens sees at least as much as the previous token alone.
    assert np.all(reuse_per_layer(source.expert_ids, pos, 4) >= reuse_per_layer(source.expert_ids, pos) - 1e-12)


def test_fitted_statistics_carry_over(source, fitted):
    gen = generate_trace(fitted, 6000, seed=5)
    real_reuse, gen_reuse = stats.token_reuse_by_layer(source), stats.token_reuse_by_layer(gen)
    assert np.abs(gen_reuse - real_reuse).max() < 0.05, (real_reuse, gen_reuse)
    assert np.abs(stats.layer_popularity(gen) - stats.layer_popularity(source)).max() < 0.04
    pos = positions_in_request(gen.request_offsets)
    assert np.abs(reuse_per_layer(gen.expert_ids, pos, fitted.window) - fitted.reuse_window).max() < 0.05


def test_params_json_round_trip(fitted):
    d = json.loads(json.dumps(fitted.to_dict()))
    again = SyntheticParams.from_dict(d)
    assert again.to_dict() == d
    np.testing.assert_allclose(again.popularity, fitted.popularity, atol=1e-4)


def test_default_params_are_small_and_local(default_params):
    assert len(json.dumps(default_params.to_dict())) < 300_000
    p = default_params
    assert (p.num_layers, p.num_experts, p.top_k) == (26, 64, 6)
    t = generate_trace(p, 4000, seed=0)
    # The source (DeepSeek-V2-Lite, Puffin) reuses 0.26 = 2.8 x K/E; uniform routing gives K/E.
    assert stats.token_reuse(t) > 2.5 * p.top_k / p.num_experts
    assert abs(stats.token_reuse(t) - float(p.reuse.mean())) < 0.03


def test_fit_rejects_window_below_two(source):
    with pytest.raises(UserError, match="window"):
        fit_synthetic_params(source, window=1)

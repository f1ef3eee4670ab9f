"""The forecaster's long-range head (`seqmoe.brain.predict.far_head`) and how the policy reads it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from seqmoe.brain.policies.forecast import ForecastPolicy  # noqa: E402
from seqmoe.brain.predict.checkpoints import load_seq_predictor, save_checkpoint  # noqa: E402
from seqmoe.brain.predict.provide import seq_predictor_for  # noqa: E402
from seqmoe.brain.predict.far_head import RHO, fit_far_head, gru_states, tokens_to_next_use  # noqa: E402
from seqmoe.brain.predict.seqmodel import SeqConfig, SeqPredictor  # noqa: E402
from tests.conftest import make_trace  # noqa: E402

CFG = SeqConfig(num_layers=3, num_experts=8, top_k=2, hash_buckets=32, embed_dim=16, hidden_dim=12, query_dim=20)


def weights(cfg=CFG, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in cfg.weight_shapes().items()}


def test_tokens_to_next_use():
    t = make_trace(num_tokens=30, num_layers=2, num_experts=4, top_k=1, num_requests=1)
    g = tokens_to_next_use(t)
    u = t.uids().reshape(30, -1)
    for tok in (0, 7, 20):
        for uid in range(8):
            later = [s for s in range(tok + 1, 30) if uid in u[s]]
            assert g[tok, uid] == (later[0] - tok if later else min(200, 30 + 200 - tok))


def test_the_fitted_head_beats_a_constant():
    trace = make_trace(num_tokens=600, num_requests=4, seed=3)
    pred = SeqPredictor(CFG, weights())
    head = fit_far_head(pred, trace, epochs=400)
    assert head["far_w"].shape == (24, 12) and head["far_b"].shape == (24,)
    y = RHO ** (tokens_to_next_use(trace).astype(np.float64) - 1)
    v = 1 / (1 + np.exp(-(gru_states(pred, trace) @ head["far_w"].T + head["far_b"])))
    const = np.clip(y.mean(0), 1e-6, 1 - 1e-6)

    def bce(p):
        return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())

    assert bce(v) < bce(np.broadcast_to(const, y.shape))


def test_the_head_gives_values_per_token_and_cuts_the_window_forecast():
    cfg = SeqConfig(**{**CFG.to_dict(), "far_head": True})
    w = weights(cfg)
    trace = make_trace(num_tokens=20, num_requests=1)
    pred = SeqPredictor(cfg, w, window=0)
    L = 3
    pred.begin_token(0, None)
    fc = pred.predict(-1)
    assert fc.steps.tolist() == list(range(L))  # the current token only
    want = 1 / (1 + np.exp(-(w["far_w"] @ w["h0"] + w["far_b"]).astype(np.float64)))
    assert np.allclose(pred.far, want, atol=1e-6)
    pred.observe(0, trace.expert_ids[0, 0])
    pred.begin_token(L, None)
    assert not np.allclose(pred.far, want)  # a new state, new values
    plain = pred.with_window(0, far_head=False)
    plain.begin_token(0, None)
    assert plain.far is None and len(plain.predict(-1).steps) == 2 * L
    assert pred.with_window(None).horizon == 2 * L and pred.horizon == L


def test_the_policy_multiplies_its_prior_by_the_head():
    train = make_trace(num_tokens=200, seed=1)
    a, b = ForecastPolicy.from_trace(train), ForecastPolicy.from_trace(train)
    far = np.linspace(0.1, 1.0, 24)
    for p in (a, b):
        p.reset(range(6))
    b.set_far(far)  # (a reset forgets it)
    assert np.allclose(b.values(), a.values() * far)


def test_checkpoints_with_and_without_the_head(tmp_path, monkeypatch):
    trace = make_trace(num_tokens=300, num_requests=3, seed=4)
    save_checkpoint(tmp_path / "old", CFG, weights(), {})
    old = load_seq_predictor(tmp_path / "old")
    assert not old.config.far_head and old.far is None
    # A cached forecaster from before the head: fitted once and written back.
    from seqmoe.brain.predict import checkpoints

    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path / "cache"))
    cached = checkpoints.cache_dir() / "predictors" / checkpoints.trace_fingerprint(trace)
    save_checkpoint(cached, CFG, weights(), {"note": "kept"})
    got = seq_predictor_for(None, trace)
    assert got.config.far_head and got.info["note"] == "kept"
    again = load_seq_predictor(cached)
    assert again.config.far_head and np.array_equal(again.w["far_w"], got.w["far_w"])

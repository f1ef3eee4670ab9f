"""Sequence forecaster: training, incremental numpy inference against the torch twin, checkpoints.

Run: .venv/bin/python -m pytest tests/brain/predict/test_seqmodel.py -q
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from seqmoe.base.errors import UserError  # noqa: E402
from seqmoe.brain.predict.buckets import trace_buckets  # noqa: E402
from seqmoe.brain.predict.evaluate import evaluate_predictor  # noqa: E402
from seqmoe.brain.predict.checkpoints import load_seq_predictor, save_checkpoint  # noqa: E402
from seqmoe.brain.predict.seqmodel import SeqConfig, SeqPredictor  # noqa: E402
from seqmoe.brain.predict.seqnet import SeqNet  # noqa: E402
from seqmoe.brain.predict.train import train_seq_predictor  # noqa: E402
from seqmoe.trace.schema import RoutingTrace, TraceMeta  # noqa: E402
from tests.conftest import make_trace  # noqa: E402

TINY = dict(hash_buckets=32, embed_dim=16, hidden_dim=16, query_dim=16, num_streams=4, window=8, max_minutes=None, threads=1,
            progress=False)


def with_tokens(trace: RoutingTrace, vocab_size: int = 10, seed: int = 0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, trace.num_tokens).astype(np.int32)
    return dataclasses.replace(trace, token_ids=ids, vocab=tuple(f"tok{i}" for i in range(vocab_size)))


@pytest.fixture(scope="module")
def tiny_trace() -> RoutingTrace:
    return with_tokens(make_trace(num_tokens=300, num_layers=3, num_experts=8, top_k=2, num_requests=6, seed=1))


@pytest.fixture(scope="module")
def trained(tiny_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("pred")
    info = train_seq_predictor(tiny_trace, out, epochs=4, seed=0, lr=1e-2, **TINY)
    return out, info


def random_net(cfg: SeqConfig, seed: int = 0) -> SeqNet:
    torch.manual_seed(seed)
    net = SeqNet(cfg)
    with torch.no_grad():  # non-trivial values everywhere (h0, norms and biases start at 0 or 1)
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return net


def teacher_forced(net: SeqNet, trace: RoutingTrace, buckets: np.ndarray):
    """Non-incremental recompute of one request: [T, L + 1, 2, L, E] logits for every (t, l_known)."""
    ids = torch.from_numpy(trace.expert_ids.astype(np.int64))
    b = torch.from_numpy(buckets)
    T, L = ids.shape[0], ids.shape[1]
    with torch.no_grad():
        x = net.gru_inputs(ids, b)[:, None]  # [T, 1, D]
        start = torch.zeros(T, 1, dtype=torch.bool)
        start[0] = True
        h_prev, _ = net.run_gru(x, start, None)
        part = net.partial_sums(ids)  # [T, L + 1, Z]
        lk = torch.arange(-1, L).repeat(T)
        tok = torch.arange(T).repeat_interleave(L + 1)
        logits = net.query(h_prev[:, 0][tok], part[tok, lk + 1], lk, b[tok])
    return logits.view(T, L + 1, 2, L, -1).numpy()


def softmax_probs(logits: np.ndarray, k: int) -> np.ndarray:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return np.minimum(k * e / e.sum(-1, keepdims=True), 1.0)


def test_loss_falls(trained):
    _, info = trained
    hist = info["history"]
    assert len(hist) == 4
    assert hist[-1]["train_loss"] < hist[0]["train_loss"] - 0.05
    assert hist[-1]["val_loss"] < hist[0]["val_loss"]
    assert info["metrics"]["best_epoch"] >= 1
    assert not info["training"]["cut_short"]


def test_a_time_limit_that_cuts_training_says_so(tiny_trace, tmp_path):
    lines = []
    info = train_seq_predictor(tiny_trace, tmp_path, epochs=4, seed=0, **{**TINY, "max_minutes": 1e-9},
                               log=lines.append)
    assert info["training"]["cut_short"] and info["training"]["epochs_run"] == 1
    assert "limit in epoch 1 of 4" in lines[-1]


def test_forecast_shapes_and_probabilities(trained, tiny_trace):
    pred = load_seq_predictor(trained[0])
    pred.check_trace(tiny_trace)
    L, E, K = 3, 8, 2
    assert pred.predict(0) is None  # nothing begun yet
    pred.begin_request()
    pred.begin_token(0, int(tiny_trace.token_ids[0]))
    fc = pred.predict(-1)
    assert fc.steps.tolist() == list(range(0, 2 * L))
    pred.observe(0, tiny_trace.expert_ids[0, 0])
    fc = pred.predict(0)
    assert fc.steps.tolist() == list(range(1, 2 * L))  # rest of token 0 and all of token 1
    assert fc.probs.shape == (2 * L - 1, E) and fc.probs.dtype == np.float32
    assert (fc.probs >= 0).all() and (fc.probs <= 1).all()
    assert np.allclose(fc.probs.sum(1), K, atol=0.5)
    far = pred.forecast(0, 5 * L)
    assert far.steps.tolist() == list(range(1, 1 + len(far.steps))) and far.steps[-1] >= 5 * L
    assert np.array_equal(far.probs[: len(fc.steps)], fc.probs)
    assert (far.probs >= 0).all() and (far.probs <= 1).all()


def test_incremental_equals_recompute(tiny_trace):
    cfg = SeqConfig(num_layers=3, num_experts=8, top_k=2, hash_buckets=32, embed_dim=16, hidden_dim=12, query_dim=20)
    net = random_net(cfg)
    req = tiny_trace.select_requests([2])
    buckets = trace_buckets(req, cfg.hash_buckets)
    ref = teacher_forced(net, req, buckets)  # [T, L + 1, 2, L, E]
    pred = SeqPredictor(cfg, net.export())
    pred.check_trace(req)
    T, L, K = req.expert_ids.shape
    worst = 0.0
    pred.begin_request()
    for t in range(T):
        pred.begin_token(t * L, int(req.token_ids[t]))
        for lk in range(-1, L):
            if lk >= 0:
                pred.observe(t * L + lk, req.expert_ids[t, lk])
            fc = pred.predict(t * L + lk)
            want = softmax_probs(ref[t, lk + 1].reshape(2 * L, -1)[lk + 1:], K)
            worst = max(worst, float(np.abs(fc.probs - want).max()))
    assert worst < 1e-4, f"max |incremental - recompute| = {worst:.2e}"


@pytest.mark.parametrize("window", [0, 1, 2])
def test_forecast_window(tiny_trace, window):
    """Window W: the next W rows follow the reference forecast, the rows further out keep the latest
    forecast that computed them; W = 0: only the token's first forecast, then None."""
    cfg = SeqConfig(num_layers=3, num_experts=8, top_k=2, hash_buckets=32, embed_dim=16, hidden_dim=12, query_dim=20)
    weights = random_net(cfg, seed=2).export()
    ref, win = SeqPredictor(cfg, weights), SeqPredictor(cfg, weights, window=window)
    req = tiny_trace.select_requests([1])
    T, L, _ = req.expert_ids.shape
    for p in (ref, win):
        p.check_trace(req)
        p.begin_request()
    latest = None  # [2L, E] rows of the current token as the windowed predictor should hold them
    for t in range(T):
        for p in (ref, win):
            p.begin_token(t * L, int(req.token_ids[t]))
        for lk in range(-1, L):
            if lk >= 0:
                for p in (ref, win):
                    p.observe(t * L + lk, req.expert_ids[t, lk])
            want, got = ref.predict(t * L + lk), win.predict(t * L + lk)
            if lk == -1:
                latest = want.probs.copy()
            elif window == 0:
                assert got is None
                continue
            else:
                latest[lk + 1: lk + 1 + window] = want.probs[:window]
            assert got.steps.tolist() == want.steps.tolist()
            assert np.abs(got.probs - latest[lk + 1:]).max() < 1e-5


def test_recursive_step_equals_recompute(tiny_trace):
    """The third token of a forecast comes from one GRU step on x_hat and an unknown-token query."""
    cfg = SeqConfig(num_layers=3, num_experts=8, top_k=2, hash_buckets=32, embed_dim=16, hidden_dim=12, query_dim=20)
    net = random_net(cfg, seed=1)
    pred = SeqPredictor(cfg, net.export())
    pred.check_trace(tiny_trace)
    L, E, K = 3, 8, 2
    pred.begin_request()
    pred.begin_token(0, int(tiny_trace.token_ids[0]))
    pred.observe(0, tiny_trace.expert_ids[0, 0])
    fc = pred.forecast(0, 3 * L)
    direct = fc.probs[: 2 * L - 1]
    soft = np.zeros((L, E), dtype=np.float32)  # x_hat: true layer 0, forecast layers 1..L-1
    soft[0, tiny_trace.expert_ids[0, 0]] = 1.0
    soft[1:] = direct[: L - 1]
    b = int(trace_buckets(tiny_trace, 32)[0])
    with torch.no_grad():
        x = torch.from_numpy(soft.reshape(-1)) @ net.route_in + net.tok_in[b]
        h = net.gru(x[None], net.h0[None])
        logits = net.query(h, torch.zeros(1, cfg.query_dim), torch.tensor([-1]), torch.tensor([32]))
    want = softmax_probs(logits[0, 1].numpy(), K)
    assert fc.steps[2 * L - 1] == 2 * L
    assert np.abs(fc.probs[2 * L - 1: 3 * L - 1] - want).max() < 1e-4


def test_save_load_round_trip(trained, tiny_trace, tmp_path):
    pred = load_seq_predictor(trained[0])
    save_checkpoint(tmp_path, pred.config, pred.w, pred.info)
    again = load_seq_predictor(tmp_path)
    for p in (pred, again):
        p.check_trace(tiny_trace)
        p.begin_request()
        p.begin_token(0, int(tiny_trace.token_ids[0]))
        p.observe(0, tiny_trace.expert_ids[0, 0])
    a, b = pred.forecast(0, 9), again.forecast(0, 9)
    assert np.array_equal(a.steps, b.steps) and np.array_equal(a.probs, b.probs)
    doc = json.loads((trained[0] / "config.json").read_text())
    assert doc["config"]["num_layers"] == 3 and "metrics" in doc and "training" in doc


def test_errors(trained, tmp_path):
    pred = load_seq_predictor(trained[0])
    other = make_trace(num_tokens=20, num_layers=4, num_experts=8, top_k=2, num_requests=2)
    with pytest.raises(UserError, match="L=4"):
        pred.check_trace(other)
    with pytest.raises(UserError, match="no predictor folder"):
        load_seq_predictor(tmp_path / "missing")
    with pytest.raises(UserError, match="lacks"):
        load_seq_predictor(tmp_path)
    (tmp_path / "config.json").write_text((trained[0] / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="unreadable weights"):
        load_seq_predictor(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(UserError, match="unreadable predictor config"):
        load_seq_predictor(tmp_path)


def test_learns_repeated_routing(tmp_path):
    """Every token repeats the same routing: the forecast one token ahead must find it."""
    T, L, E = 240, 3, 8
    ids = np.tile(np.array([[0, 5], [3, 1], [7, 2]], dtype=np.int16), (T, 1, 1))
    offsets = np.array([0, 60, 120, 180, 240])
    trace = RoutingTrace(expert_ids=ids, request_offsets=offsets, meta=TraceMeta(num_experts=E))
    train_seq_predictor(trace, tmp_path, epochs=3, seed=0, lr=2e-2, **TINY)
    pred = load_seq_predictor(tmp_path)
    pred.check_trace(trace)
    res = evaluate_predictor(trace.head(60), pred, horizons=(1, L, 2 * L))
    assert res["recall_at_k"][L] > 0.95 and res["recall_at_k"][1] > 0.95 and res["recall_at_k"][2 * L] > 0.9


def test_cli_train_and_eval(tiny_trace, tmp_path, capsys):
    import argparse

    from seqmoe.cli.predict import add_predict_commands
    from seqmoe.trace.io import save_trace

    parser = argparse.ArgumentParser(prog="seqmoe")
    add_predict_commands(parser.add_subparsers(dest="command", required=True))
    save_trace(tiny_trace, tmp_path / "t.safetensors")
    out = tmp_path / "pred"
    args = parser.parse_args(["train", "--trace", str(tmp_path / "t.safetensors"), "--out", str(out),
                              "--epochs", "1", "--threads", "1", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["training"]["epochs_run"] == 1
    args = parser.parse_args(["eval-predictor", "--trace", str(tmp_path / "t.safetensors"), "--predictor", str(out),
                              "--train", str(tmp_path / "t.safetensors"), "--plot", str(tmp_path / "r.png"), "--json"])
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res["predictors"]) == {"seqmoe", "frequency", "affinity-style", "moe-infinity-style", "expertflow-style"}
    assert (tmp_path / "r.png").exists()
    args = parser.parse_args(["eval-predictor", "--trace", str(tmp_path / "t.safetensors"), "--predictor", str(out),
                              "--draft", "ngram", "--tokens-ahead", "5", "--json"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert set(res["predictors"]) == {"seqmoe", "seqmoe + ngram drafts"} and res["horizons"][-1] == 5 * 3
    assert any(line.split()[-1] == "h=5L" for line in lines)
    args = parser.parse_args(["train", "--trace", str(tmp_path / "t.safetensors"), "--out", str(out), "--epochs", "0"])
    with pytest.raises(UserError, match="epochs"):
        args.func(args)

"""The forecaster learned online: its schedule, its determinism, the compiled manager taking the same
swaps as the reference, the cache of what it learned.
Run: pytest tests/brain/predict/test_online.py -q
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from seqmoe.base.errors import UserError
from seqmoe.brain.manager import SystemInputs, build_system, capacity_for
from seqmoe.brain.predict.checkpoints import load_online
from seqmoe.brain.predict.online import (
    NoLearner, OnlineForecaster, OnlineSchedule, cold_prior, fit_prior, learn_round, online_config, online_forecaster,
)
from seqmoe.brain.predict.learner import ProcessLearner
from seqmoe.brain.predict.checkpoints import save_checkpoint
from seqmoe.sim import simulate
from tests.conftest import make_trace, tiny_hardware

torch = pytest.importorskip("torch")
from seqmoe.brain.predict.train import OnlineTrainer  # noqa: E402

SHAPE = dict(num_layers=4, num_experts=16, top_k=3)
QUICK = OnlineSchedule(warmup=32, period=64, lag=16, buffer=256)


class _Recorder:
    """A learner that hands back fixed weights and notes what it was given."""

    def __init__(self, weights):
        self.weights, self.submitted, self._ready = weights, [], False

    def submit(self, snapshot, tokens_learned):
        self.submitted.append((len(snapshot[0]), tokens_learned, snapshot[2].copy()))
        self._ready = True

    def result(self):
        if not self._ready:
            return None
        self._ready = False
        return self.weights, (np.full(4 * 16, 3 / 16), None)

    def close(self):
        pass


def _feed(fc, trace, tokens=None):
    L = trace.num_layers
    starts = set(trace.request_offsets[:-1].tolist())
    for t in range(tokens or trace.num_tokens):
        if t in starts:
            fc.begin_request()
        fc.begin_token(t * L, None)
        for l in range(L):
            fc.observe(t * L + l, trace.expert_ids[t, l])
            fc.predict(t * L + l)


def test_the_schedule_submits_swaps_and_counts_in_tokens():
    cfg = online_config(**SHAPE)
    weights = OnlineTrainer(cfg).net.export()
    rec = _Recorder(weights)
    fc = OnlineForecaster(cfg, rec, QUICK)
    trace = make_trace(num_tokens=200, **SHAPE)
    _feed(fc, trace, 40)
    assert fc.predict(39 * 4 + 3) is None and fc.inner is None  # nothing learned yet: no forecast
    _feed_more = lambda n: [fc.begin_token(t * 4, None) or [fc.observe(t * 4 + l, trace.expert_ids[t, l])  # noqa: E731
                                                            for l in range(4)] for t in range(40, n)]
    _feed_more(200)
    # Snapshots at 32 tokens and every 64 after a swap; each swapped 16 tokens later.
    assert [s[0] for s in rec.submitted] == [32, 96, 160] and [s[1] for s in rec.submitted] == [32, 96, 160]
    assert fc.swaps == [(32, 48), (96, 112), (160, 176)] and fc.tokens_learned == 160
    assert fc.inner is not None and fc.new_prior is not None
    assert rec.submitted[1][2][0]  # a snapshot's first token opens a request


def test_a_round_is_deterministic_and_the_prior_is_the_policys():
    cfg = online_config(**SHAPE)
    trace = make_trace(num_tokens=300, **SHAPE)
    starts = np.zeros(300, bool)
    starts[trace.request_offsets[:-1]] = True
    snap = (trace.expert_ids, np.full(300, cfg.hash_buckets), starts)
    (w1, (q1, r1)), (w2, (q2, r2)) = (learn_round(OnlineTrainer(cfg, seed=3), snap) for _ in range(2))
    assert all(np.array_equal(w1[k], w2[k]) for k in w1) and np.array_equal(q1, q2)
    assert np.array_equal(r1.values, r2.values)
    from seqmoe.brain.policies.forecast import ForecastPolicy

    want = ForecastPolicy.from_trace(trace)
    use_rate, reuse = fit_prior(trace.expert_ids, starts, 16)
    assert np.array_equal(reuse.values, want.reuse.values) and np.array_equal(reuse.uid_class, want.reuse.uid_class)
    assert np.allclose(use_rate, np.bincount(trace.uids().reshape(-1), minlength=64) / 300)


def test_the_learner_process_trains_what_this_process_trains(tmp_path):
    """The runtime's learner (a child process) and the simulator's give the same weights for the same
    snapshot, and the child saves the round where it was asked to."""
    cfg = online_config(**SHAPE)
    trace = make_trace(num_tokens=120, **SHAPE)
    snap = (trace.expert_ids, np.arange(120) % cfg.hash_buckets, np.zeros(120, bool))
    want, _ = learn_round(OnlineTrainer(cfg), snap)
    child = ProcessLearner(cfg, save_to=tmp_path / "fc")
    try:
        child.submit(snap, 120)
        got = None
        for _ in range(600):
            got = child.result()
            if got is not None:
                break
            import time

            time.sleep(0.1)
    finally:
        child.close()
    assert got is not None and all(np.array_equal(want[k], got[0][k]) for k in want)
    weights, info = load_online(tmp_path / "fc", cfg)
    assert info["tokens_learned"] == 120 and all(np.array_equal(want[k], weights[k]) for k in want)


@pytest.mark.parametrize("r", [0.25, 0.45])
def test_compiled_equals_reference_with_online_swaps(r):
    """On seqmoe-tiny's held-out routing the compiled manager takes each swap (weights and prior) where
    the reference does: the same counts, which the swaps changed (learning paused gives others)."""
    from seqmoe.costs.profiles import get_model_profile
    from seqmoe.arch.tiny.traces import load_demo_traces

    test = load_demo_traces()[1].head(900)
    L, E, K = test.num_layers, test.num_experts, test.top_k
    C = capacity_for(r, L, E, K)
    out = []
    for compiled, learner in ((False, None), (True, None), (True, NoLearner())):
        fc = online_forecaster(L, E, K, schedule=QUICK)
        fc.learner = learner or fc.learner
        inp = SystemInputs(train=test, test=test, capacity=C, start=(), prior=cold_prior(L, E, K), predictor=fc)
        c = simulate(test, build_system("seqmoe", inp), model=get_model_profile("seqmoe-tiny"),
                     hardware=tiny_hardware(3e9), capacity=C, start=[], compiled=compiled)
        out.append({k: v for k, v in dataclasses.asdict(c).items() if k != "decision_s"})
        assert len(fc.swaps) == (0 if learner else 14)
    assert out[0] == out[1] and out[2]["misses"] != out[0]["misses"]


def test_online_replays_are_refused_where_they_mean_nothing():
    from seqmoe.config import SimConfig

    with pytest.raises(UserError, match="drop --predictor"):
        SimConfig(trace="t", online=True, system="seqmoe", predictor="p")
    with pytest.raises(UserError, match="learns from a training trace"):
        SimConfig(trace="t", online=True, system="affinity-style")


def test_a_corrupt_or_foreign_cached_forecaster_is_ignored_with_a_warning(tmp_path):
    cfg = online_config(**SHAPE)
    weights = OnlineTrainer(cfg).net.export()
    good = {"online": {"tokens_learned": 5, "use_rate": [0.1] * 64}}
    save_checkpoint(tmp_path / "ok", cfg, weights, good)
    assert load_online(tmp_path / "ok", cfg)[1]["tokens_learned"] == 5
    assert load_online(tmp_path / "absent", cfg) is None
    other = online_config(num_layers=4, num_experts=16, top_k=2)
    save_checkpoint(tmp_path / "foreign", other, OnlineTrainer(other).net.export(), good)
    save_checkpoint(tmp_path / "cut", cfg, weights, good)
    data = (tmp_path / "cut" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    save_checkpoint(tmp_path / "bare", cfg, weights, {})
    doc = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text(json.dumps(doc)[:40])
    (tmp_path / "garbled" / "model.safetensors").write_bytes(data)
    for name in ("foreign", "cut", "bare", "garbled"):
        with pytest.warns(UserWarning, match="ignoring the cached forecaster"):
            assert load_online(tmp_path / name, cfg) is None


def test_calibrate_learns_from_text_and_offload_starts_from_it(tmp_path, monkeypatch):
    """`seqmoe calibrate --text DIR` writes the forecaster `offload` then starts from; a folder with no
    text is a clear error before the model loads."""
    from seqmoe.cli import main
    from seqmoe.arch.collect import load_model
    from seqmoe.runtime import offload

    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.py").write_text("def parse(argv):\n    return [a.strip() for a in argv]\n" * 40)
    assert main(["calibrate", "--text", str(tmp_path / "text"), "--tokens", "400", "--no-progress"]) == 0
    model, _ = load_model("seqmoe-tiny", device="cpu", dtype="float32")
    rt = offload(model, 0.3)
    s = rt.stats()["forecaster"]
    rt.restore()
    assert s["source"] == "cache" and s["tokens_learned"] >= 400
    (tmp_path / "empty").mkdir()
    assert main(["calibrate", "--text", str(tmp_path / "empty")]) == 2


@pytest.mark.parametrize("damage", ["nan", "inf", "huge", "random_bytes", "string_rate", "nested_rate", "nan_rate",
                                    "negative_rate", "negative_tokens", "bool_tokens"])
def test_a_cache_with_bad_numbers_is_ignored_not_used(tmp_path, damage):
    """Each of these crashed (or was reported as is) in a later run of the seqmoe system."""
    cfg = online_config(**SHAPE)
    weights = OnlineTrainer(cfg).net.export()
    info = {"tokens_learned": 5, "use_rate": [0.1] * 64}
    name = next(iter(weights))
    if damage in ("nan", "inf", "huge"):
        weights = {**weights, name: np.full_like(weights[name], {"nan": np.nan, "inf": np.inf, "huge": 3e38}[damage])}
    info.update({"string_rate": {"use_rate": "0.1"}, "nested_rate": {"use_rate": [[0.1]] * 64},
                 "nan_rate": {"use_rate": [float("nan")] * 64}, "negative_rate": {"use_rate": [-0.1] * 64},
                 "negative_tokens": {"tokens_learned": -5}, "bool_tokens": {"tokens_learned": True}}.get(damage, {}))
    save_checkpoint(tmp_path / "fc", cfg, weights, {"online": info})
    if damage == "random_bytes":  # a valid header, then noise where the numbers were
        path = tmp_path / "fc" / "model.safetensors"
        data = bytearray(path.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        data[start:] = np.random.default_rng(0).integers(0, 256, len(data) - start, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="ignoring the cached forecaster"):
        assert load_online(tmp_path / "fc", cfg) is None

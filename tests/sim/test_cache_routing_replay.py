"""Cache-aware routing replayed by the simulator on a trace's router logits (`simulate(max_kl=...)`)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from seqmoe.cli import main
from seqmoe.base.errors import UserError
from seqmoe.brain.manager import SystemInputs, build_system, capacity_for, start_placement
from seqmoe.sim import simulate
from seqmoe.trace.io import load_trace, save_trace
from seqmoe.trace.schema import RoutingTrace, TraceError, TraceMeta
from tests.conftest import make_trace, tiny_hardware, tiny_model


def logit_trace(num_tokens=300, num_layers=4, num_experts=16, top_k=2, seed=0) -> RoutingTrace:
    """A trace whose routing is the top-k of its recorded router logits (gate weights: the softmax
    probabilities, not renormalised)."""
    rng = np.random.default_rng(seed)
    bias = rng.normal(0, 1.5, (1, num_layers, num_experts))  # some experts popular
    z = (bias + rng.normal(0, 1, (num_tokens, num_layers, num_experts))).astype(np.float32)
    ids = np.argsort(-z, axis=-1, kind="stable")[..., :top_k].astype(np.int16)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = np.take_along_axis(p, ids.astype(np.int64), -1).astype(np.float32)
    offsets = np.array([0, num_tokens // 2, num_tokens], np.int64)
    return RoutingTrace(expert_ids=ids, request_offsets=offsets, gate_weights=w, router_logits=z,
                        meta=TraceMeta(model="tiny", num_experts=num_experts, source="test"))


def _replay(trace, max_kl, name="on-demand-lru", r=0.25, compiled=True):
    train = logit_trace(seed=9)
    C = capacity_for(r, trace.num_layers, trace.num_experts, trace.top_k)
    start = start_placement(train, C)
    system = build_system(name, SystemInputs(train=train, test=trace, capacity=C, start=tuple(start)))
    return simulate(trace, system, model=tiny_model(trace), hardware=tiny_hardware(), capacity=C, start=start,
                    max_kl=max_kl, compiled=compiled)


def _counts(c):
    return {k: v for k, v in dataclasses.asdict(c).items() if k not in ("decision_s", "routing")}


def test_a_zero_budget_replays_the_recorded_routing():
    trace = logit_trace()
    exact, zero = _replay(trace, None), _replay(trace, 0.0)
    assert _counts(zero) == _counts(exact) and zero.routing["substitutions"] == 0 and exact.routing is None


@pytest.mark.parametrize("name", ["on-demand-lru", "seqmoe-markov-forecast"])
def test_a_budget_saves_misses_within_it_and_both_managers_agree(name):
    trace = logit_trace()
    exact = _replay(trace, None, name)
    for max_kl in (0.02, 0.2):
        c = _replay(trace, max_kl, name)
        assert c.misses < exact.misses and c.routing["substitutions"] > 0
        assert 0 < c.routing["mean_kl"] <= max_kl
        ref = _replay(trace, max_kl, name, compiled=False)
        assert _counts(ref) == _counts(c) and ref.routing == c.routing
    assert _replay(trace, 0.2, name).misses < _replay(trace, 0.02, name).misses  # more budget, fewer misses


@pytest.mark.parametrize("name", ["on-demand-lru", "seqmoe-markov-forecast"])
def test_a_batched_replay_spends_each_rows_budget(name):
    from seqmoe.sim.lockstep import lockstep

    trace, train = logit_trace(num_tokens=300), logit_trace(seed=9)
    trace = dataclasses.replace(trace, request_offsets=np.arange(0, 301, 30, dtype=np.int64))  # 10 requests
    plan = lockstep(trace, 4)
    C = capacity_for(0.25, trace.num_layers, trace.num_experts, trace.top_k)
    start = start_placement(train, C)

    def replay(max_kl, compiled=True):
        system = build_system(name, SystemInputs(train=train, test=trace, capacity=C, start=tuple(start),
                                                 visits=plan.uids(trace)))
        return simulate(trace, system, model=tiny_model(trace), hardware=tiny_hardware(), capacity=C, start=start,
                        max_kl=max_kl, compiled=compiled, plan=plan)

    exact, zero = replay(None), replay(0.0)
    assert _counts(zero) == _counts(exact) and zero.routing["substitutions"] == 0
    c = replay(0.2)
    assert c.misses < exact.misses and c.routing["substitutions"] > 0 and c.steps == exact.steps < 300
    assert 0 < c.routing["mean_kl"] <= 0.2  # per token: each row spends its own budget
    ref = replay(0.2, compiled=False)
    assert _counts(ref) == _counts(c) and ref.routing == c.routing


def test_a_trace_without_router_logits_is_refused():
    trace = make_trace(num_layers=4, num_experts=16)
    with pytest.raises(UserError, match="--router-logits"):
        _replay(dataclasses.replace(trace, gate_weights=np.ones(trace.expert_ids.shape, np.float32)), 0.01)


def test_router_logits_survive_save_and_load_and_are_checked(tmp_path):
    trace = logit_trace(num_tokens=40)
    save_trace(trace, tmp_path / "t.safetensors")
    back = load_trace(tmp_path / "t.safetensors")
    assert np.array_equal(back.router_logits, trace.router_logits)
    assert np.array_equal(back.select_requests([1]).router_logits, trace.router_logits[20:])
    with pytest.raises(TraceError, match="router_logits"):
        dataclasses.replace(trace, router_logits=trace.router_logits[:, :2])


def test_sim_cli_replays_cache_aware_routing(tmp_path, capsys):
    save_trace(logit_trace(), tmp_path / "test.safetensors")
    save_trace(logit_trace(seed=9), tmp_path / "train.safetensors")
    profile = tmp_path / "m.json"
    profile.write_text(json.dumps(dict(name="m", num_layers=4, num_experts=16, top_k=2, expert_bytes=1_000_000)))
    args = ["sim", "--trace", str(tmp_path / "test.safetensors"), "--train", str(tmp_path / "train.safetensors"),
            "--model-profile", str(profile), "--residency", "0.25", "--json"]
    assert main(args + ["--routing", "cache-aware", "--max-kl", "0.05"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["routing"] == "cache-aware" and row["substitutions"] > 0 and "bound_time_s" not in row
    assert main(args + ["--routing", "cache-aware"]) == 2
    assert "max_kl" in capsys.readouterr().err

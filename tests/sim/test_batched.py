"""Batched replay (docs/DESIGN.md, "Batched decode"): the lockstep schedule, counts per activation,
the cost of a step, the bound, and both managers agreeing.
Run: pytest tests/sim/test_batched.py -q
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from seqmoe.brain.policies.belady import FutureUses, belady_misses
from seqmoe.config import SimConfig
from seqmoe.base.errors import UserError
from seqmoe.brain.manager import SystemInputs, build_system, capacity_for, start_placement
from seqmoe.sim import simulate
from seqmoe.sim.lockstep import lockstep
from seqmoe.sim.run import load_workload, run_one
from seqmoe.trace.schema import RoutingTrace
from tests.conftest import make_trace, tiny_hardware, tiny_model

SHAPE = dict(num_layers=4, num_experts=16, top_k=3)


def test_lockstep_runs_every_token_once_and_refills_a_finished_lane_at_the_next_step():
    trace = make_trace(num_tokens=100, num_requests=7, **SHAPE)
    plan = lockstep(trace, 3)
    live = plan.rows[plan.rows >= 0]
    assert sorted(live.tolist()) == list(range(trace.num_tokens))
    starts = trace.request_offsets[:-1]
    assert sorted(plan.rows[plan.new].tolist()) == starts.tolist()
    for b in range(3):  # a lane runs its requests back to back, in file order, each token after the previous
        col = plan.rows[:, b]
        col = col[col >= 0]
        assert (np.diff(col) > 0).all()
    first_lane_of = {int(plan.rows[s, b]): b for s, b in zip(*np.nonzero(plan.new))}
    assert [first_lane_of[int(x)] for x in starts[:3]] == [0, 1, 2]
    np.testing.assert_array_equal(lockstep(trace, 1).rows[:, 0], np.arange(trace.num_tokens))


def _replay(name, trace, train, r, batch, compiled=True, miss="copy", bw=3e9):
    C = capacity_for(r, trace.num_layers, trace.num_experts, trace.top_k)
    start = start_placement(train, C)
    plan = lockstep(trace, batch)
    visits = None if batch == 1 else plan.uids(trace)
    system = build_system(name, SystemInputs(train=train, test=trace, capacity=C, start=tuple(start), visits=visits), miss)
    hw = dataclasses.replace(tiny_hardware(bw), host_memory_bytes_per_s=5e9, host_cores=8)
    c = simulate(trace, system, model=tiny_model(trace), hardware=hw, capacity=C, start=start, compiled=compiled,
                 plan=plan)
    return c, C, start, visits


@pytest.mark.parametrize("name", ["on-demand-lru", "seqmoe-markov-forecast", "seqmoe-prior-eviction", "belady"])
@pytest.mark.parametrize("miss", ["copy", "auto"])
def test_counts_are_per_activation_and_both_managers_agree(name, miss):
    train, test = make_trace(num_tokens=300, seed=5, **SHAPE), make_trace(num_tokens=160, num_requests=6, seed=1, **SHAPE)
    got = []
    for compiled in (False, True):
        c, C, start, visits = _replay(name, test, train, 0.5, 4, compiled, miss)
        got.append({k: v for k, v in dataclasses.asdict(c).items() if k != "decision_s"})
    ref, fast = got
    if name != "belady":  # the oracle runs the reference manager either way
        assert fast == ref
    assert ref["ready"] + ref["late"] + ref["misses"] == test.num_tokens * test.num_layers * test.top_k
    assert ref["num_tokens"] == test.num_tokens and ref["steps"] == lockstep(test, 4).num_steps
    assert ref["expert_reads"] == int(sum(len(set(row.tolist())) for step in visits for row in step))
    if miss == "copy":  # no copy-only system beats Belady over the steps' expert sets
        assert ref["copies"] >= belady_misses(visits, C, start, FutureUses(visits, 64))


def test_a_step_reads_each_expert_once_for_all_its_rows():
    """Four copies of one request at batch 4 cost what the request costs alone, and count 4x the activations."""
    one = make_trace(num_tokens=40, num_requests=1, seed=3, **SHAPE)
    four = RoutingTrace(expert_ids=np.concatenate([one.expert_ids] * 4), request_offsets=np.arange(5) * 40,
                        meta=one.meta)
    alone, *_ = _replay("on-demand-lru", one, one, 0.5, 1)
    together, *_ = _replay("on-demand-lru", four, one, 0.5, 4)
    assert together.steps == alone.steps == 40
    assert together.full_load_time_s == pytest.approx(alone.full_load_time_s)
    assert together.time_s == pytest.approx(alone.time_s)
    assert together.copies == alone.copies
    assert (together.ready, together.late, together.misses) == (4 * alone.ready, 4 * alone.late, 4 * alone.misses)


def test_run_one_reports_steps_and_refuses_what_it_cannot_replay(tmp_path):
    train, test = make_trace(num_tokens=300, seed=5, **SHAPE), make_trace(num_tokens=160, num_requests=6, seed=1, **SHAPE)
    profile = tmp_path / "tiny.json"
    profile.write_text(json.dumps(tiny_model(test).to_dict()))
    cfg = SimConfig(trace="t", train="t", model_profile=str(profile), system="seqmoe-markov-forecast",
                    residency=0.5, batch=4)
    w = load_workload(cfg, train=train, test=test)
    row = run_one(w, cfg)
    assert row["batch"] == 4 and row["num_tokens"] == 160 and row["steps"] == lockstep(test, 4).num_steps
    assert row["time_per_step_s"] == pytest.approx(row["time_s"] / row["steps"])
    assert 0 < row["bound_fraction"] <= 1 and row["activations"] == 160 * 4 * 3
    tight = run_one(w, dataclasses.replace(cfg, residency=0.1, system="on-demand-lru"))  # 6 slots, up to 12 experts a layer
    assert tight["misses_in_place"] > 0 and tight["activations"] == 160 * 4 * 3  # the rest of a layer is read in place
    with pytest.raises(UserError, match="--batch"):
        SimConfig(trace="t", batch=0)
    windowed = run_one(w, dataclasses.replace(cfg, window_tokens=30))
    assert {k: v for k, v in windowed.items() if k not in ("windows", "config", "config_hash", "sim_wall_s",
                                                            "activations_per_s", "decision_us_per_token")} == \
        {k: v for k, v in row.items() if k not in ("config", "config_hash", "sim_wall_s", "activations_per_s",
                                                    "decision_us_per_token")}
    wins = windowed["windows"]  # each opens at the first step boundary at or after a multiple of 30 tokens
    assert sum(x["tokens"] for x in wins) == 160 and len(wins) == 6
    assert all(30 * i <= x["first_token"] < 30 * i + 4 for i, x in enumerate(wins))
    assert [x["first_token"] for x in wins[1:]] == [sum(x["tokens"] for x in wins[:i + 1]) for i in range(len(wins) - 1)]
    assert sum(x["time_s"] for x in wins) == pytest.approx(row["time_s"])


@pytest.mark.parametrize("max_skips", [0, 2, 4])
def test_overlap_admission_runs_every_token_once_and_passes_the_head_over_at_most_max_skips_times(max_skips):
    trace = make_trace(num_tokens=400, num_requests=30, seed=9, **SHAPE)
    plan = lockstep(trace, 4, "overlap", max_skips)
    assert sorted(plan.rows[plan.rows >= 0].tolist()) == list(range(trace.num_tokens))
    starts = trace.request_offsets[:-1].tolist()
    order = [starts.index(int(plan.rows[s, b])) for s, b in zip(*np.nonzero(plan.new))]  # requests, as admitted
    waiting, run = list(range(len(starts))), 0
    for r in order:
        run = 0 if r == waiting[0] else run + 1  # consecutive admissions that passed the head over
        assert run <= max_skips
        waiting.remove(r)
    assert (order != sorted(order)) == (max_skips > 0)  # the rule reorders, unless the bound forbids it


def test_sim_batch_flags_reach_the_result_row(tmp_path):
    from seqmoe.cli import main

    out = tmp_path / "rows.jsonl"
    D = Path(__file__).resolve().parents[2] / "src/seqmoe/data"
    code = main(["sweep", "--trace", f"{D}/seqmoe-tiny-test.safetensors", "--train", f"{D}/seqmoe-tiny-train.safetensors",
                 "--model-profile", "seqmoe-tiny", "--systems", "on-demand-lru", "--residencies", "0.45",
                 "--max-tokens", "300", "--batch", "4", "--admission", "overlap", "--out", str(out)])
    row = json.loads(out.read_text().splitlines()[0])
    assert code == 0 and row["batch"] == 4 and row["admission"] == "overlap" and row["num_tokens"] == 300

"""The prefill extension (`seqmoe.sim.prefill`): a prompt is one forward of P positions that reads each
routed expert once per layer; its time to first token against full load, the bound and the pool.
Run: pytest tests/sim/test_prefill.py -q
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from seqmoe.cli import main
from seqmoe.config import SimConfig
from seqmoe.base.errors import UserError
from seqmoe.costs.profiles import HARDWARE_PROFILES, MODEL_PROFILES, HardwareProfile
from seqmoe.sim.prefill import (check_prompt_lengths, full_load_time, prefill_bound, prefill_costs, prefill_time,
                                prompt_rows, prompt_starts)
from seqmoe.sim.run import load_workload, run_one
from seqmoe.trace.io import save_trace
from tests.conftest import make_trace, tiny_model

PATHS = ("copy", "in-place", "cpu", "auto")


def _hardware(**kw) -> HardwareProfile:
    """A machine whose link, host and device all matter at the tiny model's sizes."""
    base = dict(name="prefill-hw", h2d_bytes_per_s=1e10, copy_overhead_s=1e-5, hbm_bytes_per_s=1e12,
                device_memory_bytes=1 << 30, host_memory_bytes_per_s=5e10, host_cores=8, device_flops_per_s=1e14,
                host_flops_per_s=2e12)
    return HardwareProfile(**{**base, **kw})


def _model(trace):
    return dataclasses.replace(tiny_model(trace), expert_params=500_000, layer_flops=2_000_000, token_flops=1_000_000,
                               head_flops=4_000_000)


def _prompt(P=64, seed=0):
    trace = make_trace(num_tokens=P, num_layers=4, num_experts=16, top_k=3, num_requests=1, seed=seed)
    return trace, prompt_rows(trace.expert_ids, 16)


def test_rows_count_positions_and_each_expert_is_moved_once_for_all_its_rows():
    trace, rows = _prompt(P=64)
    P, L, K = trace.expert_ids.shape
    assert rows.shape == (L, 16) and (rows.sum(axis=1) == P * K).all()
    for l in range(L):
        assert (rows[l] > 0).sum() == len(np.unique(trace.expert_ids[:, l]))
    costs = prefill_costs(_model(trace), _hardware())
    cold = prefill_time(rows, np.zeros_like(rows, dtype=bool), costs, "copy", P)
    assert cold.transfers == int((rows > 0).sum()) < P * L * K and cold.host_experts == 0
    # the same routing at every position: K experts a layer, however long the prompt
    same = prompt_rows(np.repeat(trace.expert_ids[:1], 200, axis=0), 16)
    assert prefill_time(same, np.zeros_like(same, dtype=bool), costs, "copy", 200).transfers == L * K


@pytest.mark.parametrize("miss", PATHS)
def test_a_full_pool_gives_the_full_load_time_and_an_empty_one_stays_above_the_bound(miss):
    trace, rows = _prompt()
    costs = prefill_costs(_model(trace), _hardware())
    full = full_load_time(rows, costs, 64)
    got = prefill_time(rows, np.ones(rows.shape, dtype=bool), costs, miss, 64)
    assert got.time_s == pytest.approx(full) and got.transfers == got.host_experts == 0
    empty = np.zeros(rows.shape, dtype=bool)
    assert prefill_time(rows, empty, costs, miss, 64).time_s >= prefill_bound(rows, empty, costs, 64) > full


def test_time_falls_as_experts_become_resident_and_the_bound_stays_below_every_path():
    trace, rows = _prompt(seed=3)
    costs = prefill_costs(_model(trace), _hardware())
    rng = np.random.default_rng(0)
    resident = np.zeros(rows.shape, dtype=bool)
    last = {m: np.inf for m in PATHS}
    for uid in rng.permutation(rows.size):
        resident.flat[uid] = True
        bound = prefill_bound(rows, resident, costs, 64)
        got = {m: prefill_time(rows, resident, costs, m, 64).time_s for m in PATHS}
        for m in ("copy", "in-place"):  # a resident expert saves its transfer and costs nothing more
            assert got[m] <= last[m] + 1e-15
        assert got["auto"] <= got["copy"] + 1e-15  # moving every miss is one of auto's choices
        assert min(got.values()) >= bound - 1e-15
        last = got


def test_a_host_expert_costs_per_row_and_a_transfer_does_not():
    trace, _ = _prompt()
    costs = prefill_costs(_model(trace), _hardware())
    resident = np.ones((1, 16), dtype=bool)
    resident[0, 0] = False
    times = {}
    for m in (1, 4000):
        rows = np.zeros((1, 16), dtype=np.int64)
        rows[0, 0], rows[0, 1] = m, 3  # expert 0 missing with m rows, expert 1 resident
        times[m] = {p: prefill_time(rows, resident, costs, p, m + 3).time_s for p in ("copy", "cpu", "auto")}
    assert costs.host_s(np.array([4000]))[0] > 10 * costs.host_s(np.array([1]))[0]
    # the non-expert parts grow alike on both paths; the host's expert grows with its rows, the copy does not
    assert times[1]["cpu"] < times[1]["copy"] and times[4000]["cpu"] > times[4000]["copy"]
    assert times[1]["auto"] == pytest.approx(min(times[1]["cpu"], times[1]["copy"]))
    assert times[4000]["auto"] == pytest.approx(min(times[4000]["cpu"], times[4000]["copy"]))


def test_bad_prompt_lengths_and_profiles_are_refused():
    for bad in ([0], [-3], ["512"], [True], [1.5]):
        with pytest.raises(UserError, match="positive"):
            check_prompt_lengths(bad, 100)
    with pytest.raises(UserError, match="longer than the replayed trace"):
        check_prompt_lengths([101], 100)
    assert check_prompt_lengths([8, 8, 4], 100) == (8, 4)
    with pytest.raises(UserError, match="no request starts"):
        prompt_starts(np.array([0, 50, 100]), 100, 101)
    np.testing.assert_array_equal(prompt_starts(np.array([0, 50, 100]), 100, 50), [0, 50])
    np.testing.assert_array_equal(prompt_starts(np.array([0, 50, 100]), 100, 60), [0])
    trace, rows = _prompt()
    with pytest.raises(UserError, match="device_flops_per_s"):
        prefill_costs(_model(trace), _hardware(device_flops_per_s=None))
    with pytest.raises(UserError, match="host"):
        prefill_time(rows, rows > 0, prefill_costs(_model(trace), _hardware(host_cores=None, host_memory_bytes_per_s=None)), "cpu", 64)
    for field, value in (("compute_efficiency", 0.0), ("compute_efficiency", 1.5), ("device_flops_per_s", -1.0)):
        with pytest.raises(UserError, match=field):
            _hardware(**{field: value})


def test_presets_price_prompts():
    for hw in HARDWARE_PROFILES.values():
        assert hw.device_flops_per_s and hw.host_flops_per_s and 0 < hw.compute_efficiency <= 1
    for m in MODEL_PROFILES.values():
        assert m.layer_flops > 0 and m.head_flops > 0
    ds = MODEL_PROFILES["deepseek-v2-lite"]  # bf16: 2 FLOPs and 2 bytes per weight
    assert ds.layer_flops == ds.layer_bytes and ds.token_flops < ds.token_bytes  # token_bytes holds the lm_head


def test_run_one_adds_prefill_without_changing_the_replay(tmp_path):
    train, test = make_trace(num_tokens=300, seed=5, num_layers=4, num_experts=16, top_k=3), \
        make_trace(num_tokens=240, num_requests=8, seed=1, num_layers=4, num_experts=16, top_k=3)
    model, hw = tmp_path / "m.json", tmp_path / "hw.json"
    model.write_text(json.dumps(_model(test).to_dict()))
    hw.write_text(json.dumps(_hardware().to_dict()))
    cfg = SimConfig(trace="t", train="t", model_profile=str(model), hardware=str(hw), system="on-demand-lru",
                    residency=0.4, miss="auto")
    w = load_workload(cfg, train=train, test=test)
    plain, row = run_one(w, cfg), run_one(w, cfg, prompt_lengths=(16, 64))
    for k in ("time_s", "ready", "late", "misses", "copies", "misses_cpu"):
        assert row[k] == plain[k]
    for P in (16, 64):
        p = row["prefill"][str(P)]
        assert p["prompts"] == len(prompt_starts(test.request_offsets, test.num_tokens, P))
        assert p["full_load_ttft_s"] <= p["bound_ttft_s"] <= p["ttft_s"] <= p["cold_ttft_s"]
        assert 0 < p["resident_share"] < 1
    batch = dataclasses.replace(cfg, batch=2)  # priced from the pool at the step where each request starts
    bplain, brow = run_one(w, batch), run_one(w, batch, prompt_lengths=(16,))
    assert all(brow[k] == bplain[k] for k in ("time_s", "ready", "late", "misses", "copies", "misses_cpu"))
    p = brow["prefill"]["16"]
    assert p["prompts"] == row["prefill"]["16"]["prompts"]
    assert p["full_load_ttft_s"] <= p["bound_ttft_s"] <= p["ttft_s"] <= p["cold_ttft_s"]
    save_trace(test, tmp_path / "test.safetensors")
    save_trace(train, tmp_path / "train.safetensors")
    args = ["sim", "--trace", str(tmp_path / "test.safetensors"), "--train", str(tmp_path / "train.safetensors"),
            "--model-profile", str(model), "--hardware", str(hw), "--residency", "0.4", "--system", "on-demand-lru"]
    assert main(args + ["--prompt-lengths", "0"]) == 2
    assert main(args + ["--prompt-lengths", "1000"]) == 2
    assert main(args + ["--prompt-lengths", "16,64"]) == 0


def test_a_sweep_prices_prompts_in_each_row(tmp_path):
    train, test = make_trace(num_tokens=300, seed=5, num_layers=4, num_experts=16, top_k=3), \
        make_trace(num_tokens=240, num_requests=8, seed=1, num_layers=4, num_experts=16, top_k=3)
    model, hw = tmp_path / "m.json", tmp_path / "hw.json"
    model.write_text(json.dumps(_model(test).to_dict()))
    hw.write_text(json.dumps(_hardware().to_dict()))
    save_trace(test, tmp_path / "test.safetensors")
    save_trace(train, tmp_path / "train.safetensors")
    out = tmp_path / "rows.jsonl"
    args = ["sweep", "--trace", str(tmp_path / "test.safetensors"), "--train", str(tmp_path / "train.safetensors"),
            "--model-profile", str(model), "--hardware", str(hw), "--residencies", "0.3,0.5",
            "--systems", "on-demand-lru,belady", "--prompt-lengths", "16,64", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(set(row["prefill"]) == {"16", "64"} for row in rows)
    single = tmp_path / "one.jsonl"  # a run's row as `sim` gives it for the same run
    assert main(["sim", *args[1:9], "--residency", "0.5", "--system", "belady", "--prompt-lengths", "16,64",
                 "--out", str(single), "--no-progress"]) == 0
    assert rows[3]["prefill"] == json.loads(single.read_text())["prefill"]
    assert main(args[:-3] + ["--twin", "int4", "--out", str(out), "--no-progress"]) == 1  # runs fail, each says why
    assert all("gate weights" in json.loads(line)["error"] for line in out.read_text().splitlines())

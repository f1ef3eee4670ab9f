"""The disk tier in the simulator: a host cache of H rows in front of the disk, series with the
device pool's transfers (seqmoe.brain.manager.disk_clock).  Run: pytest tests/sim/test_disk.py -q"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from seqmoe.brain.policies.belady import belady_misses
from seqmoe.config import SimConfig
from seqmoe.base.errors import UserError
from seqmoe.brain.manager import build_manager, Driver
from seqmoe.brain.manager.counts import summarize
from seqmoe.brain.manager.placement import capacity_for, start_placement
from seqmoe.brain.manager.systems import SystemInputs, baselines, build_system
from seqmoe.brain.manager.disk_clock import DiskClock
from seqmoe.brain.manager.host_tier import HostTier
from seqmoe.costs.profiles import disk_read_s
from seqmoe.sim import simulate
from seqmoe.sim.run import load_workload, run_one
from tests.conftest import make_trace, tiny_hardware, tiny_model

DATA = Path(__file__).resolve().parents[2] / "src/seqmoe/data"
DISK_FIELDS = {"host_rows", "disk_reads", "disk_bytes", "disk_bytes_per_token", "host_needs", "host_hit_rate",
               "disk_ahead_reads", "disk_ahead_used", "disk_stall_s", "disk_read_s", "host_hits",
               "decision_us_per_token"}


def _hw(bandwidth=2e9, latency=80e-6, host=True):
    hw = tiny_hardware()
    extra = dict(host_memory_bytes_per_s=5e10, host_cores=8) if host else {}
    return dataclasses.replace(hw, disk_bytes_per_s=bandwidth, disk_latency_s=latency, **extra)


def _run(name, train, test, residency, hw, rows=None, miss="copy", compiled=True, host_policy=None):
    C = capacity_for(residency, test.num_layers, test.num_experts)
    start = start_placement(train, C)
    system = build_system(name, SystemInputs(train=train, test=test, capacity=C, start=tuple(start)), miss)
    model = tiny_model(test)
    c = simulate(test, system, model=model, hardware=hw, capacity=C, start=start, host_rows=rows, compiled=compiled,
                 host_policy=host_policy)
    return summarize(c, expert_bytes=model.expert_bytes), start


@pytest.mark.parametrize("name,miss", [("on-demand-lru", "copy"), ("moe-infinity-style", "copy"),
                                       ("expertflow-style", "copy"), ("belady", "copy"), ("on-demand-lru", "auto"),
                                       ("on-demand-lru", "in-place"), ("on-demand-lru", "cpu"), ("cpu-all", "copy")])
def test_a_disk_of_no_time_changes_nothing_but_the_disk_fields(name, miss):
    # Every transfer waits for its row and then takes its own cost, which the manager already
    # charges from the same moment: with a disk that takes no time the rows are today's.
    train, test = make_trace(seed=3), make_trace(seed=4, num_tokens=90)
    base, _ = _run(name, train, test, 0.4, _hw(), None, miss)
    got, _ = _run(name, train, test, 0.4, _hw(bandwidth=1e300, latency=0.0), 6, miss)
    assert got["disk_stall_s"] == 0.0 and got["disk_reads"] > 0
    assert {k: v for k, v in got.items() if k not in DISK_FIELDS} == {k: v for k, v in base.items() if k not in DISK_FIELDS}


class _Needs:
    """An inner observer: records the uids whose rows the manager's transfers read."""

    def __init__(self):
        self.uids = set()
        self.events = 0

    def on_load(self, uid, demand, deadline_step):
        self.uids.add(uid)
        self.events += 1

    def on_promote(self, uid):
        self.events += 1

    def on_evict(self, uid):
        self.events += 1

    def on_off_pool(self, uid, path):
        self.uids.add(uid)
        self.events += 1


@pytest.mark.parametrize("compiled", [True, False])
def test_a_host_cache_of_every_expert_reads_each_missing_expert_once(compiled):
    train, test = make_trace(seed=5), make_trace(seed=6, num_tokens=100)
    L, E = test.num_layers, test.num_experts
    C = capacity_for(0.3, L, E)
    start = start_placement(train, C)
    system = build_system("on-demand-lru", SystemInputs(train=train, test=test, capacity=C, start=tuple(start)))
    model, hw = tiny_model(test), _hw()
    disk = DiskClock(HostTier(L * E, L, E, read_s=disk_read_s(model, hw), start=start), model=model, hardware=hw)
    inner = _Needs()
    manager = build_manager(system, model=model, hardware=hw, capacity=C, start=start, observer=disk.observer(inner),
                            compiled=compiled)
    d = Driver(manager, disk=disk)
    for t in range(test.num_tokens):
        d.token_start(None, False)
        for l in range(L):
            d.reveal(l, test.expert_ids[t, l])
            d.layer_end(l)
    got = summarize(d.finish(), expert_bytes=model.expert_bytes)
    base, _ = _run("on-demand-lru", train, test, 0.3, hw, compiled=compiled)
    assert inner.events > 0  # the inner observer hears every event
    assert got["disk_reads"] == len(inner.uids - set(start))  # never evicted, so each read once
    assert got["host_needs"] - got["host_hits"] == got["disk_reads"]
    # The device pool decides as before (on-demand LRU reads no clock); only time grows.
    for k in ("hit_rate", "misses", "copies"):
        assert got[k] == base[k]
    assert got["time_s"] > base["time_s"]
    assert got["time_s"] == pytest.approx(got["full_load_time_s"] + got["stall_s"])
    assert got["stall_s"] - base["stall_s"] == pytest.approx(got["disk_stall_s"], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("name", ["on-demand-lru", "moe-infinity-style"])
@pytest.mark.parametrize("policy", ["lru", "forecast"])
def test_disk_reads_are_the_host_misses_and_at_least_belady_at_c_plus_h(name, policy):
    train, test = make_trace(seed=7), make_trace(seed=8, num_tokens=120)
    rows = 8
    got, start = _run(name, train, test, 0.25, _hw(), rows, host_policy=policy)
    demand_reads = got["disk_reads"] - got["disk_ahead_reads"]
    assert demand_reads == got["host_needs"] - got["host_hits"]
    C = capacity_for(0.25, test.num_layers, test.num_experts)
    assert got["disk_reads"] >= belady_misses(test.uids(), C + rows, start)
    if policy == "lru":
        assert got["disk_ahead_reads"] == 0


def _tiny_cfg(**kw):
    kw = {"hardware": "rtx4090-pcie4", **kw}
    return SimConfig(trace=str(DATA / "seqmoe-tiny-test.safetensors"), train=str(DATA / "seqmoe-tiny-train.safetensors"),
                     model_profile="seqmoe-tiny", max_tokens=300, **kw)


def test_the_two_tier_bound_holds_for_every_system_on_seqmoe_tiny():
    cfg = _tiny_cfg(residency=0.25, host_residency=0.4)
    w = load_workload(cfg)
    runs = [(name, "copy") for name in baselines()] + [("on-demand-lru", m) for m in ("auto", "in-place", "cpu")]
    for name, miss in runs:
        row = run_one(w, dataclasses.replace(cfg, system=name, miss=miss))
        assert row["host_rows"] == int(0.4 * 8 * 32) and row["host_residency"] == row["host_rows"] / (8 * 32)
        assert row["disk_bound_time_s"] == row["disk_belady_misses"] * row["disk_read_s"]
        assert row["paths_bound_time_s"] <= row["time_s"] * (1 + 1e-9), name
        assert row["disk_bound_time_s"] <= row["time_s"] * (1 + 1e-9), name
        if row["miss"] == "copy" and name != "cpu-all":
            assert row["bound_time_s"] <= row["time_s"] * (1 + 1e-9), name
        assert row["disk_reads"] >= row["disk_belady_misses"], name
        assert row["disk_belady_misses"] <= row["belady_misses"]  # more slots, fewer misses


@pytest.mark.parametrize("name", ["on-demand-lru", "moe-infinity-style", "seqmoe-markov-forecast"])
def test_a_batched_replay_with_a_disk_of_no_time_changes_nothing_but_the_disk_fields(name):
    from seqmoe.sim.lockstep import lockstep

    train, test = make_trace(seed=3), make_trace(seed=4, num_tokens=90, num_requests=6)
    C = capacity_for(0.4, test.num_layers, test.num_experts)
    start = start_placement(train, C)
    plan = lockstep(test, 3)
    model = tiny_model(test)
    rows = []
    for hw, host_rows in ((_hw(), None), (_hw(bandwidth=1e300, latency=0.0), 6), (_hw(), 6)):
        system = build_system(name, SystemInputs(train=train, test=test, capacity=C, start=tuple(start),
                                                 visits=plan.uids(test)))
        c = simulate(test, system, model=model, hardware=hw, capacity=C, start=start, plan=plan, host_rows=host_rows)
        rows.append(summarize(c, expert_bytes=model.expert_bytes))
    base, free, slow = rows
    assert free["disk_stall_s"] == 0.0 and free["disk_reads"] > 0 and free["steps"] < test.num_tokens
    assert {k: v for k, v in free.items() if k not in DISK_FIELDS} == {k: v for k, v in base.items() if k not in DISK_FIELDS}
    assert slow["disk_stall_s"] > 0 and slow["time_s"] > base["time_s"]


def test_the_two_tier_bound_holds_for_batched_replays_on_seqmoe_tiny():
    cfg = _tiny_cfg(residency=0.25, host_residency=0.4, batch=4)
    w = load_workload(cfg)
    for name in ("on-demand-lru", "moe-infinity-style", "belady"):
        row = run_one(w, dataclasses.replace(cfg, system=name))
        assert row["batch"] == 4 and row["steps"] < row["num_tokens"] and row["host_rows"] == int(0.4 * 8 * 32)
        assert row["disk_bound_time_s"] == row["disk_belady_misses"] * row["disk_read_s"]
        assert max(row["bound_time_s"], row["disk_bound_time_s"]) <= row["time_s"] * (1 + 1e-9), name
        assert row["disk_reads"] >= row["disk_belady_misses"], name
        assert row["disk_belady_misses"] <= row["belady_misses"]


def test_without_a_host_cache_the_row_has_no_disk_fields():
    cfg = _tiny_cfg(residency=0.25)
    row = run_one(load_workload(cfg), cfg)
    assert not DISK_FIELDS - {"decision_us_per_token"} & set(row)
    assert "host_memory" not in row["config"]  # config hashes of runs without a disk tier stay as they were


@pytest.mark.parametrize("batch", [1, 3])
def test_twins_beside_a_disk_tier_take_their_bytes_from_its_host_memory(batch):
    """Low-bit twins live in host memory beside the host cache: the cache has the rows its host memory
    holds after them, misses are served from them without reading the disk, and the reference and
    compiled managers agree."""
    from seqmoe.brain.manager.disk_clock import host_rows
    from seqmoe.brain.manager.miss_paths import Twin
    from seqmoe.sim.lockstep import lockstep
    from tests.brain.manager.test_twin import _with_gates

    train, test = make_trace(seed=3), _with_gates(make_trace(seed=4, num_tokens=120), 4)
    model, hw = tiny_model(test), _hw()
    twins = test.num_layers * test.num_experts * model.at_precision("int4").expert_bytes
    budget = 12 * model.expert_bytes + twins
    rows = host_rows(budget, None, model, hw, twin_bytes=twins)
    assert rows == 12 == host_rows(budget, None, model, hw) - twins // model.expert_bytes
    C = capacity_for(0.25, test.num_layers, test.num_experts)
    start = start_placement(train, C)
    out = []
    for compiled in (True, False):
        system = build_system("on-demand-lru", SystemInputs(train=train, test=test, capacity=C, start=tuple(start)),
                              "copy", Twin("int4", 1.0))
        c = simulate(test, system, model=model, hardware=hw, capacity=C, start=start, host_rows=rows,
                     compiled=compiled, plan=lockstep(test, batch) if batch > 1 else None)
        out.append({k: v for k, v in summarize(c, expert_bytes=model.expert_bytes).items() if k != "decision_us_per_token"})
    assert out[0] == out[1]
    assert out[0]["misses_twin"] > 0 and out[0]["disk_reads"] > 0 and out[0]["twin_weight_per_token"] <= 1.0 + 1e-9


def test_host_memory_gives_rows_of_the_stores_precision():
    cfg = _tiny_cfg(host_memory="2MiB")
    assert cfg.host_rows() == (2 << 20) // 76800
    assert _tiny_cfg(host_memory="2MiB", expert_dtype="int4").host_rows() > cfg.host_rows()


@pytest.mark.parametrize("kw,match", [
    (dict(host_memory="100KiB"), "holds 1 experts"),
    (dict(host_memory="8 gigs"), "is not a size"),
    (dict(host_memory="1MiB", host_residency=0.5), "not both"),
    (dict(host_residency=1.5), r"\(0, 1\]"),
    (dict(host_memory="1MiB", hardware="user-file-less"), "unknown hardware profile"),
    (dict(host_memory="1MiB", twin="int4"), "of them for the low-bit twins"),
    (dict(host_policy="lru"), "needs a host cache"),
    (dict(host_memory="1MiB", host_policy="mru"), "--host-policy must be one of"),
])
def test_bad_host_options_fail_before_anything_loads(kw, match):
    with pytest.raises(UserError, match=match):
        _tiny_cfg(**kw)


def test_a_profile_without_a_disk_names_the_presets_that_have_one(tmp_path):
    f = tmp_path / "nodisk.json"
    f.write_text('{"h2d_bytes_per_s": 2.5e10, "hbm_bytes_per_s": 1e12, "device_memory_bytes": 1000000000}')
    with pytest.raises(UserError, match="describes no disk.*rtx4090-pcie4"):
        _tiny_cfg(host_memory="4MiB", hardware=str(f))


def test_the_forecast_policy_evicts_rows_the_device_holds_first():
    import numpy as np

    tier = HostTier(2, 1, 4, policy="forecast", start=[0, 1])
    tier.observe([0, 1])  # equal use rates; 1 needed more recently, so plain ties evict 0
    tier.need(0), tier.need(1)
    assert tier.victim() == 0
    held = np.array([0, 1, 0, 0], dtype=np.uint8)  # the device pool holds expert 1: its row waits for an eviction
    tier.resident = lambda: held
    assert tier.victim() == 1
    tier.need(2, busy=np.array([False, False]))
    assert not tier.has(1) and tier.has(0) and tier.has(2)

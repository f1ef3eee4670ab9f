"""`seqmoe sweep --ray` (src/seqmoe/sim/ray_sweep.py) on a local Ray of two workers: the serial sweep's
rows in its order, a run's own error in its row, a killed worker's run retried, Ctrl-C.

Run: pytest tests/sim/test_ray_sweep.py -q (skipped without ray: pip install -e '.[ray]')
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seqmoe.cli import main
from seqmoe.config import SimConfig
from seqmoe.sim.run import WALL_CLOCK_FIELDS, run_sweep, sweep_runs
from seqmoe.arch.tiny.traces import TEST_FILE, TRAIN_FILE
from seqmoe.trace.io import save_trace
from tests.conftest import make_trace, tiny_model

ray = pytest.importorskip("ray")

TINY = ["--trace", str(TEST_FILE), "--train", str(TRAIN_FILE), "--model-profile", "seqmoe-tiny"]
"""The embedded seqmoe-tiny workload: moe-infinity-style takes about a second for 3,000 tokens."""


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of two workers for the module (`ray_sweep` uses a Ray already started)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _same(a: list[dict], b: list[dict]) -> bool:
    drop = lambda rows: [{k: v for k, v in r.items() if k not in WALL_CLOCK_FIELDS} for r in rows]  # noqa: E731
    return drop(a) == drop(b)


def test_rows_equal_the_serial_sweeps_in_its_order(local_ray, tiny_forecaster, tmp_path):
    """Two traces x two hardware profiles x two residencies x four systems (one with a forecaster
    checkpoint, sent once): every field but the wall-clock ones, in the serial order."""
    from seqmoe.sim.ray_sweep import ray_sweep

    d, _, test = tiny_forecaster
    (tmp_path / "model.json").write_text(json.dumps(tiny_model(test).to_dict()))
    save_trace(make_trace(num_tokens=60, seed=23), tmp_path / "test2.safetensors")
    cfg = SimConfig(trace=str(d / "test.safetensors"), train=str(d / "train.safetensors"), residency=1.0,
                    model_profile=str(tmp_path / "model.json"), predictor=str(d / "pred"))
    grid = dict(traces=[cfg.trace, str(tmp_path / "test2.safetensors")], hardware=["h100-pcie5", "rtx4090-pcie4"])
    systems = ["on-demand-lru", "moe-infinity-style", "belady", "seqmoe"]
    runs = sweep_runs(cfg, systems, [0.3, 0.6], **grid)
    arrived = []
    rows = ray_sweep(runs, on_row=arrived.append)
    serial = list(run_sweep(cfg, systems, [0.3, 0.6], **grid))
    assert len(rows) == len(arrived) == 32 and not any("error" in r for r in rows)
    assert [(r["config"]["trace"], r["config"]["hardware"], r["residency"], r["system"]) for r in rows] == [
        (run.trace, run.hardware, run.residency, run.system) for run in runs]
    assert _same(rows, serial)
    assert rows[0]["hardware_profile"]["name"] == "h100-pcie5" and rows[8]["hardware_profile"]["name"] == "rtx4090-pcie4"


def test_a_runs_own_error_is_its_row_and_the_sweep_goes_on(local_ray, tmp_path, capsys):
    """Residency 0.01 leaves fewer slots than one layer routes to: those runs fail alone, serial and
    with --ray alike; the exit status says some failed."""
    argv = ["sweep", *TINY, "--max-tokens", "200", "--systems", "on-demand-lru,affinity-style",
            "--residencies", "0.01,0.3"]
    assert main(argv + ["--out", str(tmp_path / "serial.jsonl"), "--plot", str(tmp_path / "plots")]) == 1
    assert main(argv + ["--out", str(tmp_path / "ray.jsonl"), "--ray"]) == 1
    err = capsys.readouterr().err
    assert "2 of 4 runs failed" in err and "FAILED" in err
    serial, rows = ([json.loads(x) for x in (tmp_path / f).read_text().splitlines()] for f in ("serial.jsonl", "ray.jsonl"))
    assert ["error" in r for r in rows] == [True, True, False, False] and _same(rows, serial)
    assert "one layer" in rows[0]["error"] and "traceback" not in rows[0]  # a UserError: its message is enough
    assert len(list((tmp_path / "plots").iterdir())) > 0  # from the rows that have metrics


def _running_tasks() -> list[int]:
    """PIDs of Ray worker processes running a sweep task (Ray titles them "ray::_run")."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "cmdline").read_bytes().startswith(b"ray::_run"):
                pids.append(int(p.name))
        except OSError:
            pass
    return pids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker processes in /proc")
def test_a_killed_workers_run_is_retried_no_row_lost_or_twice(local_ray):
    """A worker killed while it runs a task: Ray runs the task again; every row once, as serial."""
    from seqmoe.sim.ray_sweep import ray_sweep

    cfg = SimConfig(trace=str(TEST_FILE), train=str(TRAIN_FILE), model_profile="seqmoe-tiny", residency=1.0,
                    max_tokens=3000)
    systems, residencies = ["on-demand-lru", "moe-infinity-style"], [0.25, 0.45, 0.65]
    killed = []

    def kill_one(row):  # at the first row (a quick LRU run) the other worker is running moe-infinity-style
        deadline = time.monotonic() + 2
        while not killed and time.monotonic() < deadline:
            for pid in _running_tasks()[:1]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    rows = ray_sweep(sweep_runs(cfg, systems, residencies), on_row=kill_one)
    assert killed, "no running task to kill"
    assert len(rows) == 6 and not any("error" in r for r in rows)
    assert _same(rows, list(run_sweep(cfg, systems, residencies)))


def test_ctrl_c_cancels_the_tasks_and_writes_nothing(tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "seqmoe", "sweep", *TINY, "--systems", "moe-infinity-style", "--residencies",
           "0.2,0.3,0.4,0.5,0.6,0.7", "--out", str(out), "--ray", "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stderr:  # the first row: Ray is up and tasks are running
            lines.append(line)
            if "moe-infinity-style" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert proc.returncode == 130, "".join(lines) + rest
    assert "not written" in rest and not out.exists() and list(tmp_path.iterdir()) == []
    time.sleep(1)
    assert _running_tasks() == []


def test_without_ray_the_flag_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if it were not installed
    assert main(["sweep", *TINY, "--max-tokens", "50", "--out", str(tmp_path / "x.jsonl"), "--ray"]) == 2
    assert "pip install 'seqmoe[ray]'" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


def test_serial_runs_are_the_grid_in_order():
    cfg = SimConfig(trace="a", residency=1.0)
    runs = sweep_runs(cfg, ["belady", "on-demand-lru"], [0.2, 0.4], traces=["a", "b"], hardware=["h100-pcie5", "a100-pcie4"])
    assert [(r.trace, r.hardware, r.residency, r.system) for r in runs][:5] == [
        ("a", "h100-pcie5", 0.2, "belady"), ("a", "h100-pcie5", 0.2, "on-demand-lru"), ("a", "h100-pcie5", 0.4, "belady"),
        ("a", "h100-pcie5", 0.4, "on-demand-lru"), ("a", "a100-pcie4", 0.2, "belady")]
    assert len(runs) == 16 and runs[-1] == dataclasses.replace(cfg, trace="b", hardware="a100-pcie4", residency=0.4,
                                                               system="on-demand-lru")

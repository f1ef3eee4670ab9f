"""docs/DESIGN.md's reference hit rates on real DeepSeek-V2-Lite traces (skipped without ../shared).

Unseen prompts: the last 200 Puffin prompts in file order; training: the rest.
Run: pytest tests/sim/test_real_traces.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from seqmoe.config import SimConfig
from seqmoe.sim.run import load_workload, run_one
from seqmoe.trace.io import load_trace


@pytest.fixture(scope="module")
def workload(shared_traces):
    puffin = load_trace(shared_traces / "deepseek-v2-lite-puffin/puffin")
    R = puffin.num_requests
    train, test = puffin.select_requests(np.arange(R - 200)), puffin.select_requests(np.arange(R - 200, R))
    cfg = SimConfig(trace="puffin[-200:]", train="puffin[:-200]")
    return cfg, load_workload(cfg, train=train, test=test)


@pytest.mark.parametrize("system, reference", [("on-demand-lru", 0.655), ("belady", 0.860)])
def test_reference_hit_rates_at_045(workload, system, reference):
    cfg, w = workload
    row = run_one(w, SimConfig(**(cfg.to_dict() | {"system": system, "residency": 0.45})))
    assert abs(row["hit_rate"] - reference) <= 0.01
    assert row["activations"] > 2_500_000


def test_oracle_prefetch_reaches_the_bound(workload):
    cfg, w = workload
    row = run_one(w, SimConfig(**(cfg.to_dict() | {"system": "oracle-prefetch", "residency": 0.45})))
    assert row["hit_rate"] == 1.0
    assert row["bound_fraction"] >= 0.95


def test_batched_replays_with_twins_and_with_a_disk_tier_on_the_shared_traces(shared_traces, capsys):
    """`seqmoe sim --batch 4 --twin int4` (Mixtral-8x7B's JSONL routing, with gate weights) and
    `seqmoe sim --batch 4 --host-memory ...` (DeepSeek-V2-Lite's Puffin routing): their rows carry the
    batch's fields, the twins' and the disk tier's."""
    import json

    from seqmoe.cli import main

    mixtral = shared_traces / "mixtral8x7b-speculative-moe/routing_data_collected"
    puffin = shared_traces / "deepseek-v2-lite-puffin/puffin"
    runs = {
        "twin": ["--trace", str(mixtral / "humaneval_2_routing.jsonl"), "--train", str(mixtral / "gsm8k_2_routing.jsonl"),
                 "--model-profile", "mixtral-8x7b", "--twin", "int4", "--residency", "0.25", "--system", "seqmoe"],
        "disk": ["--trace", str(puffin), "--max-tokens", "3000", "--host-memory", "2GiB", "--residency", "0.1",
                 "--system", "on-demand-lru"],  # seqmoe's forecaster would train on Puffin's other prompts first: minutes
    }
    for name, args in runs.items():
        assert main(["sim", *args, "--batch", "4", "--hardware", "rtx4090-pcie4", "--json", "--no-progress"]) == 0
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert row["batch"] == 4 and row["steps"] < row["num_tokens"] and row["time_per_step_s"] > 0, name
        if name == "twin":
            assert row["misses_twin"] > 0 and row["twin_weight_per_token"] <= 0.5 + 1e-9
        else:
            assert row["disk_reads"] > 0 and row["host_rows"] > 0 and row["disk_bound_time_s"] > 0
            assert 0 < row["bound_fraction"] <= 1

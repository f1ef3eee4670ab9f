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

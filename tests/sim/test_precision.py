"""The simulator prices quantized experts as the runtime packs them, and takes a memory budget in
bytes: `seqmoe sim/sweep --expert-dtype/--expert-dtypes --expert-memory`.

Run: pytest tests/sim/test_precision.py -q
"""

from __future__ import annotations

import json

import pytest

from seqmoe.cli import main
from seqmoe.costs.profiles import get_model_profile
from seqmoe.trace.io import save_trace
from tests.conftest import make_trace


@pytest.fixture
def files(tmp_path):
    """DeepSeek-V2-Lite-shaped (L=26, E=64, K=6) train and test traces."""
    save_trace(make_trace(num_tokens=60, num_layers=26, num_experts=64, top_k=6, seed=1), tmp_path / "train.safetensors")
    save_trace(make_trace(num_tokens=40, num_layers=26, num_experts=64, top_k=6, seed=2), tmp_path / "test.safetensors")
    return tmp_path


def _base(d):
    return ["--trace", str(d / "test.safetensors"), "--train", str(d / "train.safetensors"),
            "--model-profile", "deepseek-v2-lite", "--hardware", "h100-pcie5"]


def test_a_budget_holds_more_quantized_experts_and_copies_fewer_bytes(files, capsys):
    expert = get_model_profile("deepseek-v2-lite").expert_bytes
    budget = 0.25 * 26 * 64 * expert  # what bf16 experts need for r = 0.25
    out = files / "rows.jsonl"
    assert main(["sweep", *_base(files), "--systems", "on-demand-lru,belady", "--expert-memory", str(int(budget)),
                 "--expert-dtypes", "none,int8,int4", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["system"], r["expert_dtype"]): r for r in rows}
    assert len(rows) == 6 and by[("on-demand-lru", None)]["residency"] == pytest.approx(0.25, abs=1 / 1664)
    for system in ("on-demand-lru", "belady"):
        bf16, int8, int4 = (by[(system, p)] for p in (None, "int8", "int4"))
        assert int8["capacity"] >= 1.8 * bf16["capacity"] and int4["capacity"] >= 3.3 * bf16["capacity"]
        assert all(r["memory_bytes"] <= budget for r in (bf16, int8, int4))
        assert int4["model_profile"]["expert_bytes"] <= 0.3 * expert
        assert int4["misses"] < bf16["misses"] and int4["time_s"] < bf16["time_s"]


@pytest.mark.parametrize("extra, message", [
    (["--expert-memory", "1MiB"], "fewer than the 6 one layer needs"),
    (["--expert-memory", "12GB"], "is not a size"),
    (["--expert-dtype", "int3"], "unknown expert precision"),
])
def test_bad_budgets_and_precisions_are_one_line_errors(files, capsys, extra, message):
    assert main(["sim", *_base(files), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_sweep_takes_residencies_or_a_budget_not_both(files, capsys, tmp_path):
    argv = ["sweep", *_base(files), "--expert-memory", "1GiB", "--residencies", "0.5", "--out", str(tmp_path / "r.jsonl")]
    assert main(argv) == 2 and "not both" in capsys.readouterr().err

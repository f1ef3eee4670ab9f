"""`seqmoe bench-runtime` (src/seqmoe/runtime/timing/decode.py) on a tiny random OLMoE: a fast smoke test.

Run: pytest tests/runtime/timing/test_decode.py -q
"""

from __future__ import annotations

import json

import pytest

from seqmoe.base.errors import UserError
from tests.arch.collect.tiny_models import save_tiny_checkpoint
from tests.runtime.conftest import run_cli



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmoe-bench")
    save_tiny_checkpoint("olmoe", path)
    return path


def test_bench_prints_a_table_and_a_json_line(checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    assert run_cli(["bench-runtime", "--model", str(checkpoint), "--new-tokens", "4", "--repeats", "1",
                 "--residencies", "0.5,1.0", "--predictor-minutes", "0.02", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    res = json.loads(lines[-1])
    assert json.loads(out.read_text().splitlines()[-1]) == res
    assert any(line.startswith("full load") for line in lines)
    assert res["full"]["tokens_per_s"] > 0 and res["link"]["copy_s"] > 0
    runs = res["runs"]
    assert [(r["system"], r["residency"]) for r in runs] == [
        ("on-demand-lru", 0.5), ("on-demand-lru", 1.0), ("seqmoe", 0.5), ("seqmoe", 1.0)]
    for r in runs:
        assert r["exact"] and r["tokens_per_s"] > 0 and r["host_us_per_token"] >= 0 and r["gather_us_per_token"] >= 0
        for key in ("hit_rate", "ready_rate", "late_rate", "miss_rate"):
            assert 0.0 <= r[key] <= 1.0, key
        assert r["ready_rate"] + r["late_rate"] + r["miss_rate"] == pytest.approx(1.0)
    assert runs[1]["hit_rate"] == 1.0  # full residency with the trace's start placement


def test_bench_rejects_bad_systems_and_residencies(checkpoint):
    with pytest.raises(UserError, match="'belady' reads the future of the trace and cannot run live"):
        run_cli(["bench-runtime", "--model", str(checkpoint), "--systems", "belady"])
    with pytest.raises(UserError, match="comma-separated numbers"):
        run_cli(["bench-runtime", "--model", str(checkpoint), "--residencies", "half"])

"""The `seqmoe` command: results, JSON output, errors with exit code 2 and no partial files.

Run: pytest tests/test_cli.py -q
"""

from __future__ import annotations

import json

import pytest

from seqmoe.sim.report.plot import METRICS
from seqmoe.cli import main
from seqmoe.costs.profiles import get_model_profile
from seqmoe.trace.io import save_trace
from tests.conftest import make_trace

REQUIRED = ("hit_rate", "ready_rate", "late_rate", "miss_rate", "stall_s", "time_s", "full_load_time_s",
            "full_load_fraction", "bound_time_s", "bound_fraction", "bytes_copied", "wasted_copies",
            "decision_us_per_token", "config", "config_hash")


@pytest.fixture
def files(tmp_path):
    """A DeepSeek-V2-Lite-shaped (L=26, E=64, K=6) random train and test trace, and a profile file."""
    train = make_trace(num_tokens=60, num_layers=26, num_experts=64, top_k=6, seed=1)
    test = make_trace(num_tokens=30, num_layers=26, num_experts=64, top_k=6, seed=2)
    save_trace(train, tmp_path / "train.safetensors")
    save_trace(test, tmp_path / "test.safetensors")
    return tmp_path


def sim_args(d, *extra):
    return ["sim", "--trace", str(d / "test.safetensors"), "--train", str(d / "train.safetensors"),
            "--model-profile", "deepseek-v2-lite", "--hardware", "h100-pcie5", *extra]


def test_sim_json_is_the_last_line_with_every_field(files, capsys):
    assert main(sim_args(files, "--residency", "0.45", "--system", "belady", "--json")) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(k in row for k in REQUIRED)
    assert row["config"]["system"] == "belady" and row["config"]["residency"] == 0.45


@pytest.mark.parametrize("extra, message", [
    (("--system", "nope"), "unknown system 'nope'"),
    (("--residency", "1.5"), "residency must be in (0, 1]"),
    (("--residency", "0"), "residency must be in (0, 1]"),
    (("--hardware", "tpu-v9"), "unknown hardware profile 'tpu-v9'"),
    (("--model-profile", "mixtral-8x7b"), "E=64"),
])  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_no_output_file(files, capsys, extra, message):
    out = files / "row.jsonl"
    assert main(sim_args(files, *extra, "--out", str(out))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("seqmoe: error: ") and message in err and "\n" not in err
    assert not out.exists()


def test_missing_trace_file(files, capsys):
    assert main(["sim", "--trace", str(files / "absent.safetensors"), "--train", str(files / "train.safetensors")]) == 2
    assert "absent.safetensors" in capsys.readouterr().err


def test_sweep_writes_jsonl_and_plots(files, capsys):
    out, plots = files / "rows.jsonl", files / "plots"
    args = ["sweep", "--trace", str(files / "test.safetensors"), "--train", str(files / "train.safetensors"),
            "--systems", "on-demand-lru,oracle-prefetch", "--residencies", "0.2,0.5", "--out", str(out), "--plot", str(plots)]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["system"], r["residency"]) for r in rows] == [
        ("on-demand-lru", 0.2), ("oracle-prefetch", 0.2), ("on-demand-lru", 0.5), ("oracle-prefetch", 0.5)]
    assert {p.name for p in plots.iterdir()} == {f"{m}.png" for m in METRICS}
    assert {"hit_rate", "bound_fraction", "copies_per_belady"} <= set(METRICS)
    assert main(["plot", str(out), "--out", str(files / "again")]) == 0


def test_sweep_runs_traces_x_hardware_in_order_and_plots_them_apart(files, capsys):
    out, plots = files / "rows.jsonl", files / "plots"
    save_trace(make_trace(num_tokens=20, num_layers=26, num_experts=64, top_k=6, seed=3), files / "test2.safetensors")
    traces = f"{files / 'test.safetensors'},{files / 'test2.safetensors'}"
    args = ["sweep", "--trace", traces, "--train", str(files / "train.safetensors"), "--hardware", "h100-pcie5,rtx4090-pcie4",
            "--systems", "on-demand-lru", "--residencies", "0.5", "--out", str(out), "--plot", str(plots)]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["num_tokens"], r["hardware_profile"]["name"]) for r in rows] == [
        (30, "h100-pcie5"), (30, "rtx4090-pcie4"), (20, "h100-pcie5"), (20, "rtx4090-pcie4")]
    assert len(list(plots.iterdir())) == len(METRICS)
    assert main(args[:5] + ["--hardware", "h100-pcie5,nope"] + args[7:]) == 2
    assert "nope" in capsys.readouterr().err


def test_sweep_rejects_bad_residency_before_any_work(files, capsys):
    out = files / "rows.jsonl"
    args = ["sweep", "--trace", str(files / "test.safetensors"), "--residencies", "0.5,2", "--out", str(out)]
    assert main(args) == 2 and not out.exists()


def test_sim_without_train_splits_the_trace(files, capsys):
    assert main(["sim", "--trace", str(files / "train.safetensors"), "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["train_tokens"] + row["num_tokens"] == 60


def test_custom_model_profile_file(files, capsys):
    prof = get_model_profile("deepseek-v2-lite").to_dict() | {"name": "my-lite", "expert_bytes": 1_000}
    (files / "p.json").write_text(json.dumps(prof))
    assert main(sim_args(files, "--model-profile", str(files / "p.json"), "--json")) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["model_profile"]["name"] == "my-lite"


def test_systems_lists_every_baseline(capsys):
    assert main(["systems"]) == 0
    out = capsys.readouterr().out
    for name in ("on-demand-lru", "on-demand-lfu", "belady", "mixtral-offloading-style", "moe-infinity-style",
                 "affinity-style", "oracle-prefetch"):
        assert name in out


def test_demo_runs_on_embedded_data(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path / "cache"))  # trains its forecaster afresh, briefly
    assert main(["demo", "--tokens", "60", "--forecaster-minutes", "0.05", "--out", str(tmp_path / "a")]) == 0
    assert not capsys.readouterr().out.strip().splitlines()[-1].startswith("{")  # a person's table, no JSON
    assert main(["demo", "--tokens", "60", "--forecaster-minutes", "0.05", "--out", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {r["system"] for r in summary["rows"]} >= {"on-demand-lru", "oracle-prefetch", "seqmoe"}
    assert (tmp_path / "results.jsonl").exists() and (tmp_path / "hit_rate.png").exists()


def test_max_tokens_replays_a_prefix(files, capsys):
    assert main(sim_args(files, "--max-tokens", "7", "--json")) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["num_tokens"] == 7 and row["activations"] == 7 * 26 * 6
    assert main(sim_args(files, "--max-tokens", "0")) == 2


def test_every_command_prints_its_help():
    """Each command's (and subcommand's) help formats: flag help is an argparse format string."""
    from seqmoe.cli import build_parser

    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action.choices, dict):  # subcommands
                for sub in action.choices.values():
                    yield from parsers(sub)

    seen = [p.prog for p in parsers(build_parser()) if p.format_help()]
    assert "seqmoe generate" in seen and "seqmoe trace split" in seen and len(seen) > 15


def test_sweep_output_paths_that_cannot_be_written_fail_before_any_run(files, capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    for extra, message in ((["--out", str(tmp_path)], "is a folder"),
                           (["--out", str(tmp_path / "r.jsonl"), "--plot", str(tmp_path / "afile" / "plots")],
                            "is a file, not a folder")):
        assert main(["sweep", *sim_args(files)[1:], "--systems", "on-demand-lru", "--residencies", "0.5",
                     *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "on-demand-lru" not in err  # no run was made
    assert not (tmp_path / "r.jsonl").exists()


def test_non_utf8_input_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xff\xfe{"a": 1}\n')
    assert main(["plot", str(bad), "--out", str(tmp_path / "plots")]) == 2
    assert main(["trace", "import", str(bad), "--out", str(tmp_path / "t.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("not UTF-8 text" in line for line in err)


def test_trace_split_refuses_to_overwrite_its_input(files, capsys):
    src = str(files / "train.safetensors")
    assert main(["trace", "split", src, "--train", src, "--test", str(files / "t.safetensors"), "--num-test", "1"]) == 2
    assert "is the trace being split" in capsys.readouterr().err


def test_online_without_train_replays_the_whole_trace(files, capsys):
    argv = ["sim", "--trace", str(files / "test.safetensors"), "--model-profile", "deepseek-v2-lite", "--hardware",
            "h100-pcie5", "--system", "on-demand-lru", "--residency", "0.45", "--json"]
    assert main(argv + ["--online"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["num_tokens"] == 30 and row["train_tokens"] == 0  # all of it: --online trains on nothing
    assert main(argv + ["--online", "--reset", "frequency"]) == 2

"""`seqmoe trace import|info|split` end to end on small files.

Run: .venv/bin/pytest tests/test_cli_trace.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqmoe.cli import main
from seqmoe.trace.io import load_trace
from seqmoe.trace.stats import summarize

HEADER = "Layer ID,Batch Number,Token,Activated Expert IDs"


def run(argv: list[str]) -> int:
    """Exit code of `seqmoe *argv`, whether main returns it or `--help` exits."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.fixture
def csv_folder(tmp_path):
    folder = tmp_path / "csv"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for n, length in ((1, 3), (2, 5), (3, 2), (4, 4)):
        rows = []
        for layer in (1, 2, 3):
            for t in range(length):
                ids = ", ".join(map(str, rng.permutation(16)[:4]))
                rows.append(f'{layer},0,tok{t},"[{ids}]"')
        (folder / f"prompt_{n}_data.csv").write_text("\r\n".join([HEADER, *rows]) + "\r\n")
    return folder


def test_import_info_split(csv_folder, tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    assert run(["trace", "import", str(csv_folder), "--out", str(out), "--num-experts", "16"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("4 requests, 14 tokens, L=3 E=16 K=4")
    trace = load_trace(out)
    assert trace.num_requests == 4 and trace.num_experts == 16

    assert run(["trace", "info", str(out)]) == 0
    table = capsys.readouterr().out
    assert "token reuse" in table and "layer affinity" in table and "top2_share" in table

    assert run(["trace", "info", str(out), "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(summarize(trace)))

    train, test = tmp_path / "train.safetensors", tmp_path / "test.safetensors"
    split = ["trace", "split", str(out), "--train", str(train), "--test", str(test)]
    assert run([*split, "--num-test", "1", "--seed", "2"]) == 0
    assert "train: 3 requests" in capsys.readouterr().out
    assert load_trace(train).num_requests == 3 and load_trace(test).num_requests == 1


def test_split_by_fraction(csv_folder, tmp_path, capsys):
    train, test = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    split = ["trace", "split", str(csv_folder), "--train", str(train), "--test", str(test)]
    assert run([*split, "--test-fraction", "0.5"]) == 0
    assert load_trace(test).num_requests == 2


def test_errors_are_one_line_exit_2(tmp_path, capsys):
    assert run(["trace", "info", str(tmp_path / "missing.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("seqmoe: error: no such file or folder") and "\n" not in err


def test_split_that_empties_a_side_writes_nothing(csv_folder, tmp_path, capsys):
    train, test = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert run(["trace", "split", str(csv_folder), "--train", str(train), "--test", str(test), "--num-test", "4"]) == 2
    assert "each part needs at least one request" in capsys.readouterr().err
    assert not train.exists() and not test.exists()
    assert run(["trace", "split", str(csv_folder), "--train", str(train), "--test", str(train), "--num-test", "1"]) == 2
    assert "same file" in capsys.readouterr().err


def test_split_needs_exactly_one_size(csv_folder, tmp_path, capsys):
    base = ["trace", "split", str(csv_folder), "--train", str(tmp_path / "a"), "--test", str(tmp_path / "b")]
    assert run(base) == 2
    assert run([*base, "--num-test", "1", "--test-fraction", "0.5"]) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_help_texts(capsys):
    for sub in ("import", "info", "split"):
        assert run(["trace", sub, "--help"]) == 0
        assert "usage:" in capsys.readouterr().out

"""`seqmoe trace collect`: round trip through `trace info`, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqmoe.arch import model_dirs
from seqmoe.cli import main
from seqmoe.trace.io import load_trace
from tests.arch.collect.tiny_models import save_tiny_checkpoint, tiny_tokenizer

TEXT = "The cat sat on the mat.\nIt was warm.\n\nA second request.\n\n\nThird, and last."


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for arch in ("deepseek_v2", "llama"):
        save_tiny_checkpoint(arch, root / arch)
    save_tiny_checkpoint("olmoe", root / "no-tokenizer", tokenizer=False)
    return root


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def _run(capsys, *argv):
    code = main(["trace", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_collect_then_info(checkpoints, text, tmp_path, capsys):
    out = tmp_path / "trace.safetensors"
    code, stdout, _ = _run(capsys, "collect", "--model", str(checkpoints / "deepseek_v2"), "--text", str(text),
                           "--out", str(out), "--pregate", "2", "--no-progress")
    assert code == 0 and "3 requests" in stdout
    trace = load_trace(out)
    tok = tiny_tokenizer()
    paragraphs = ["The cat sat on the mat.\nIt was warm.", "A second request.", "Third, and last."]
    np.testing.assert_array_equal(trace.token_ids, np.concatenate([tok(p)["input_ids"] for p in paragraphs]))
    assert trace.meta.extra["requests"] == ["prompts.txt#0", "prompts.txt#1", "prompts.txt#2"]
    assert trace.meta.extra["moe_layers"] == [1, 2, 3] and trace.num_layers == 3  # decoder layer 0 is dense
    assert trace.pregate_logits.shape == (trace.num_tokens, 3, 2, 8)
    assert trace.gate_weights is not None
    code, stdout, _ = _run(capsys, "info", str(out), "--json")
    assert code == 0 and "pregate_logits (H=2)" in stdout
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert (summary["num_tokens"], summary["num_layers"], summary["num_requests"]) == (trace.num_tokens, 3, 3)


def test_collect_decode_mode_whole_files(checkpoints, text, tmp_path, capsys):
    out = tmp_path / "decode.safetensors"
    code, _, _ = _run(capsys, "collect", "--model", str(checkpoints / "deepseek_v2"), "--text", str(tmp_path),
                      "--out", str(out), "--mode", "decode", "--new-tokens", "3", "--requests", "file", "--no-progress")
    assert code == 0
    trace = load_trace(out)
    prompt = len(tiny_tokenizer()(TEXT.strip())["input_ids"])
    assert trace.num_requests == 1 and trace.meta.extra["prompt_tokens"] == [prompt]
    assert prompt < trace.num_tokens <= prompt + 3


def test_seqmoe_tiny_name_resolves_to_the_packaged_folder(checkpoints, text, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(model_dirs.MODEL_DIRS, "seqmoe-tiny", checkpoints / "deepseek_v2")
    out = tmp_path / "t.safetensors"
    assert _run(capsys, "collect", "--model", "seqmoe-tiny", "--text", str(text), "--out", str(out),
                "--max-requests", "1", "--no-progress")[0] == 0
    assert load_trace(out).meta.model == "seqmoe-tiny" and load_trace(out).num_requests == 1
    monkeypatch.setitem(model_dirs.MODEL_DIRS, "seqmoe-tiny", tmp_path / "missing")
    code, _, err = _run(capsys, "collect", "--model", "seqmoe-tiny", "--text", str(text),
                        "--out", str(tmp_path / "u.safetensors"), "--no-progress")
    assert code == 2 and "seqmoe-tiny is not in this install" in err
    assert not (tmp_path / "u.safetensors").exists()


@pytest.mark.parametrize(
    "model, text_name, message",
    [
        ("missing-model", "prompts.txt", "no model at"),
        ("llama", "prompts.txt", "has no MoE layers"),
        ("no-tokenizer", "prompts.txt", "has no tokenizer"),
        ("deepseek_v2", "missing.txt", "no such text file"),
    ],
)
def test_collect_errors_are_one_line(checkpoints, text, tmp_path, capsys, model, text_name, message):
    out = tmp_path / "never.safetensors"
    code, stdout, err = _run(capsys, "collect", "--model", str(checkpoints / model), "--text",
                             str(text.parent / text_name), "--out", str(out), "--no-progress")
    lines = [line for line in err.splitlines() if line.startswith("seqmoe:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not out.exists() and not list(tmp_path.glob(".never*"))


def test_collect_rejects_bad_numbers(checkpoints, text, tmp_path, capsys):
    code, _, err = _run(capsys, "collect", "--model", str(checkpoints / "deepseek_v2"), "--text", str(text),
                        "--out", str(tmp_path / "x.safetensors"), "--pregate", "-1", "--no-progress")
    assert code == 2 and "--pregate" in err

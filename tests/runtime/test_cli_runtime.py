"""`seqmoe generate` (src/seqmoe/cli/runtime.py) on a tiny saved checkpoint.

Run: pytest tests/runtime/test_cli_runtime.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from seqmoe.base.errors import UserError
from tests.arch.collect.tiny_models import save_tiny_checkpoint, tiny_tokenizer
from tests.runtime.conftest import run_cli



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmoe-tiny")
    model = save_tiny_checkpoint("olmoe", path)
    return path, model


@pytest.mark.parametrize("engine", [[], ["--control", "thread"], ["--graph"]])
def test_generate_prints_the_full_models_text_and_stats(checkpoint, capsys, engine):
    path, model = checkpoint
    prompt = "Hello MoE"
    ids = tiny_tokenizer()(prompt, return_tensors="pt")["input_ids"]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    want_text = prompt + tiny_tokenizer().decode(want[0, ids.shape[1]:], skip_special_tokens=True)
    assert run_cli(["generate", "--model", str(path), "--prompt", prompt, "--residency", "0.25", "--max-new-tokens", "6",
                 "--device", "cpu", "--json", *engine]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == want_text
    stats = json.loads(lines[-1])
    assert stats["generated_tokens"] == 6 and stats["capacity"] == 6
    assert stats["device_expert_bytes"] == 6 * stats["expert_bytes"]
    assert any("hit rate" in line for line in lines) and any("tokens/s" in line for line in lines)
    assert stats["control"] == ("inline" if not engine else "thread")


def test_generate_rejects_an_oracle_system(checkpoint):
    with pytest.raises(UserError, match="cannot run live"):
        run_cli(["generate", "--model", str(checkpoint[0]), "--prompt", "x", "--system", "belady", "--device", "cpu"])


def test_generate_routes_cache_aware_within_its_budget(checkpoint, capsys):
    argv = ["generate", "--model", str(checkpoint[0]), "--prompt", "Hello MoE", "--residency", "0.25",
            "--max-new-tokens", "6", "--device", "cpu", "--json", "--routing", "cache-aware"]
    with pytest.raises(UserError, match="--max-kl"):
        run_cli(argv)
    assert run_cli(argv + ["--max-kl", "5"]) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert stats["routing"] == "cache-aware" and stats["substitutions"] > 0 and stats["mean_kl"] <= 5


def test_generate_fits_the_pool_to_a_byte_budget(checkpoint, capsys):
    argv = ["generate", "--model", str(checkpoint[0]), "--prompt", "Hello MoE", "--max-new-tokens", "4", "--device",
            "cpu", "--json", "--expert-dtype", "int4"]
    assert run_cli(argv + ["--expert-memory", "20KiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    stats = json.loads(out[-1])
    assert stats["capacity"] == (20 << 10) // stats["expert_bytes"] and stats["expert_dtype"] == "int4"
    assert any(f"residency {stats['residency']:.4g} (from --expert-memory 20KiB)" in line for line in out)
    with pytest.raises(UserError, match="fewer than the 2 one layer needs"):
        run_cli(argv + ["--expert-memory", "1KiB"])


def test_generate_streams_experts_through_a_host_cache(checkpoint, capsys):
    path, model = checkpoint
    prompt = "Hello MoE"
    ids = tiny_tokenizer()(prompt, return_tensors="pt")["input_ids"]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    argv = ["generate", "--model", str(path), "--prompt", prompt, "--residency", "0.25", "--max-new-tokens", "6",
            "--device", "cpu", "--json", "--system", "on-demand-lru"]
    assert run_cli(argv) == 0  # the expert size, from a run without the disk tier
    expert_bytes = json.loads(capsys.readouterr().out.splitlines()[-1])["expert_bytes"]
    assert run_cli(argv + ["--host-memory", str(10 * expert_bytes)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == prompt + tiny_tokenizer().decode(want[0, ids.shape[1]:], skip_special_tokens=True)
    stats = json.loads(lines[-1])
    assert stats["host_rows"] == 10 and stats["disk_reads"] > 0 and "sim_host_expert_s" in stats
    assert any(line.startswith("disk: a host cache of 10 experts") for line in lines)


def _no_weights(monkeypatch):
    """Loading any weights fails the test: the check under test must come first."""
    def loaded(*args, **kwargs):
        raise AssertionError("weights were loaded before the bad option was refused")
    monkeypatch.setattr("seqmoe.runtime.load.load_model", loaded)
    monkeypatch.setattr("seqmoe.runtime.disk.skeleton._materialise", loaded)


@pytest.mark.parametrize("extra, message", [
    (["--expert-memory", "1KiB"], "fewer than the 2 one layer needs"),
    (["--host-memory", "1"], "the host cache needs at least"),
    (["--max-new-tokens", "1000"], "context of 256 positions; give at most 255"),
    (["--max-new-tokens", "100000000000"], "context of 256 positions"),
    (["--expert-dtype", "int4", "--twin", "int8"], "not smaller than the int4 experts"),
])
def test_generate_refuses_bad_options_before_any_weight_loads(checkpoint, monkeypatch, extra, message):
    _no_weights(monkeypatch)
    with pytest.raises(UserError, match=message):
        run_cli(["generate", "--model", str(checkpoint[0]), "--prompt", "x", "--device", "cpu", *extra])


def test_generate_refuses_a_prompt_and_completion_past_the_context(checkpoint):
    with pytest.raises(UserError, match=r"past .*context of 256 positions; give --max-new-tokens at most"):
        run_cli(["generate", "--model", str(checkpoint[0]), "--prompt", "Hello MoE", "--device", "cpu",
                 "--max-new-tokens", "255"])


def test_calibrate_refuses_no_tokens_before_the_model_loads(monkeypatch):
    monkeypatch.setattr("seqmoe.arch.collect.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UserError, match="--tokens must be at least 1"):
        run_cli(["calibrate", "--tokens", "0"])

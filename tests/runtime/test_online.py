"""seqmoe with no setup: `offload(model, residency)` runs seqmoe, learns its forecaster from the routing
it serves, keeps what it learned for the next process, and ignores a cache it cannot trust.

Run: pytest tests/runtime/test_online.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqmoe.arch.collect import load_model
from seqmoe.runtime import offload

PROMPT = [[1, 17, 42, 5]]
NEW = 300
SECOND = """
import json, torch
from seqmoe.arch.collect import load_model
from seqmoe.runtime import offload
model, _ = load_model("seqmoe-tiny", device="cpu", dtype="float32")
rt = offload(model, 0.3)
model.generate(torch.tensor([[1, 17, 42, 5]]), max_new_tokens=8, do_sample=False)
print(json.dumps(rt.stats()["forecaster"]))
rt.restore()
"""


def _tiny():
    return load_model("seqmoe-tiny", device="cpu", dtype="float32")[0]


def _generate(model, n=NEW):
    return model.generate(torch.tensor(PROMPT), max_new_tokens=n, do_sample=False)


def test_offload_with_nothing_else_runs_seqmoe_exactly_and_the_next_process_starts_from_what_it_learned(
        tmp_path, monkeypatch):
    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path))
    model = _tiny()
    want = _generate(model)
    rt = offload(model, 0.3)
    got = _generate(model)
    s = rt.stats()
    rt.restore()
    assert rt.system == "seqmoe" and torch.equal(got, want)
    assert s["forecaster"]["source"] == "new" and s["forecaster"]["tokens_seen"] >= NEW
    saved = list((tmp_path / "online").glob("*/model.safetensors"))
    assert len(saved) == 1, "a forecaster for this model is in the cache once the runtime is restored"
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", SECOND], capture_output=True, text=True, timeout=300, cwd=repo,
                         env={**__import__("os").environ, "SEQMOE_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    second = json.loads(out.stdout.strip().splitlines()[-1])
    assert second["source"] == "cache" and second["tokens_learned"] >= 128


def test_a_corrupt_cached_forecaster_is_ignored_with_a_warning_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path))
    model = _tiny()
    rt = offload(model, 0.3)
    _generate(model, 160)  # one round: the learner writes the cache
    rt.restore()
    weights = next((tmp_path / "online").glob("*/model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    want = _generate(model, 16)
    with pytest.warns(UserWarning, match="ignoring the cached forecaster"):
        rt = offload(model, 0.3)
    assert torch.equal(_generate(model, 16), want)
    assert rt.stats()["forecaster"]["source"] == "new"
    rt.restore()


def test_learning_paused_starts_no_learner(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path))
    model = _tiny()
    rt = offload(model, 0.3, learn=False)
    _generate(model, 200)
    s = rt.stats()["forecaster"]
    rt.restore()
    assert s["swaps"] == 0 and s["tokens_learned"] == 0 and not (tmp_path / "online").exists()


def test_a_short_run_keeps_what_it_saw_and_says_so(tmp_path, monkeypatch):
    """32 tokens are fewer than the first round needs (128): closing learns one last round and keeps it."""
    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path))
    model = _tiny()
    rt = offload(model, 0.3)
    _generate(model, 32)
    seen = rt.stats()["forecaster"]["tokens_seen"]
    rt.restore()
    fc = rt.controller.system.predictor
    assert fc.kept == seen >= 32
    from seqmoe.brain.predict.checkpoints import load_online

    (folder,) = [p.parent for p in (tmp_path / "online").glob("*/model.safetensors")]
    assert load_online(folder, fc.config)[1]["tokens_learned"] == fc.kept

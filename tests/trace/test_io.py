"""Saving and loading traces: safetensors roundtrip, format detection, atomic writes.

Run: .venv/bin/pytest tests/trace/test_io.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import seqmoe.trace.io as trace_io
from seqmoe.trace.io import load_trace, save_trace
from seqmoe.trace.schema import RoutingTrace, TraceError, TraceMeta

HEADER = "Layer ID,Batch Number,Token,Activated Expert IDs"


def random_trace(rng, T=7, L=3, K=2, E=6, R=2, gates=False, tokens=False) -> RoutingTrace:
    ids = np.argsort(rng.random((T, L, E)), axis=2)[:, :, :K].astype(np.int16)  # distinct per (t, l)
    cuts = np.sort(rng.choice(np.arange(1, T), size=R - 1, replace=False))
    vocab = tuple(f"tok{i},\"é" for i in range(5)) if tokens else None
    return RoutingTrace(
        expert_ids=ids,
        request_offsets=np.concatenate([[0], cuts, [T]]).astype(np.int64),
        meta=TraceMeta(model="tiny", num_experts=E, source="test", extra={"names": [f"r{i}" for i in range(R)]}),
        gate_weights=rng.random((T, L, K)).astype(np.float32) if gates else None,
        token_ids=rng.integers(0, 5, T).astype(np.int32) if tokens else None,
        vocab=vocab,
    )


def assert_same(a: RoutingTrace, b: RoutingTrace) -> None:
    assert a.expert_ids.dtype == b.expert_ids.dtype == np.int16
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    np.testing.assert_array_equal(a.request_offsets, b.request_offsets)
    assert a.meta == b.meta
    assert a.vocab == b.vocab
    for name in ("gate_weights", "token_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("gates,tokens", [(False, False), (True, False), (False, True), (True, True)])
def test_roundtrip(tmp_path, gates, tokens):
    trace = random_trace(np.random.default_rng(0), gates=gates, tokens=tokens)
    save_trace(trace, tmp_path / "t.safetensors")
    assert_same(trace, load_trace(tmp_path / "t.safetensors"))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 30), L=st.integers(1, 4), E=st.integers(2, 130))
def test_roundtrip_property(tmp_path_factory, seed, T, L, E):
    rng = np.random.default_rng(seed)
    K, R = min(E, 1 + seed % 4), min(T, 1 + seed % 3)
    trace = random_trace(rng, T=T, L=L, K=K, E=E, R=R, gates=bool(seed % 2), tokens=bool(seed % 5))
    path = tmp_path_factory.mktemp("rt") / "t.safetensors"
    save_trace(trace, path)
    assert_same(trace, load_trace(path))


def test_metadata_layout(tmp_path):
    from safetensors import safe_open

    save_trace(random_trace(np.random.default_rng(1), tokens=True), tmp_path / "t.safetensors")
    with safe_open(tmp_path / "t.safetensors", framework="numpy") as f:
        md = f.metadata()
        assert sorted(f.keys()) == ["expert_ids", "request_offsets", "token_ids"]
        assert f.get_tensor("token_ids").dtype == np.int32
    assert md["format"] == "seqmoe-trace" and md["version"] == "1"
    assert json.loads(md["meta"])["num_experts"] == 6
    assert json.loads(md["vocab"])[0] == 'tok0,"é'


def test_missing_path(tmp_path):
    with pytest.raises(TraceError, match="no such file or folder: .*nope.*expected a .safetensors trace"):
        load_trace(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("content", [b"\x00\x01garbage bytes", b"hello world\n", b""])
def test_unknown_format(tmp_path, content):
    (tmp_path / "x.bin").write_bytes(content)
    with pytest.raises(TraceError, match="unrecognised trace file .*x.bin; expected"):
        load_trace(tmp_path / "x.bin")


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"garbage garbage")
    with pytest.raises(TraceError, match="not a readable safetensors file"):
        load_trace(tmp_path / "x.safetensors")


def test_foreign_safetensors_and_version(tmp_path):
    save_file({"w": np.zeros(3, dtype=np.float32)}, tmp_path / "w.safetensors")
    with pytest.raises(TraceError, match="not a seqmoe trace"):
        load_trace(tmp_path / "w.safetensors")
    save_file({"expert_ids": np.zeros((1, 1, 1), np.int16)}, tmp_path / "v.safetensors",
              metadata={"format": "seqmoe-trace", "version": "9"})  # fmt: skip
    with pytest.raises(TraceError, match="version '9'"):
        load_trace(tmp_path / "v.safetensors")


def test_saved_trace_detected_without_extension(tmp_path):
    trace = random_trace(np.random.default_rng(2))
    save_trace(trace, tmp_path / "trace.bin")
    assert_same(trace, load_trace(tmp_path / "trace.bin"))


def test_num_experts_must_match_saved(tmp_path):
    save_trace(random_trace(np.random.default_rng(3)), tmp_path / "t.safetensors")
    with pytest.raises(TraceError, match="6 experts per layer, not 8"):
        load_trace(tmp_path / "t.safetensors", num_experts=8)


def test_no_partial_file_on_failure(tmp_path, monkeypatch):
    def broken_save(tensors, path, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(trace_io, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_trace(random_trace(np.random.default_rng(4)), tmp_path / "out.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_keeps_old_file_on_failure(tmp_path, monkeypatch):
    old = random_trace(np.random.default_rng(5))
    save_trace(old, tmp_path / "t.safetensors")
    monkeypatch.setattr(trace_io, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("boom")))
    with pytest.raises(OSError):
        save_trace(random_trace(np.random.default_rng(6)), tmp_path / "t.safetensors")
    assert_same(old, load_trace(tmp_path / "t.safetensors"))
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


def write_csv(path, rows_per_layer, num_layers=2):
    rows = [f'{layer},0,{tok},"[{ids}]"' for layer in range(1, num_layers + 1) for tok, ids in rows_per_layer]
    lines = [HEADER, *rows]
    path.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8")


def write_jsonl(path, dataset="gsm8k", problems=(0,), layers=2, tokens=2):
    recs = [
        {"dataset": dataset, "problem_id": p, "layer": l, "experts": [t % 8, (t + 1) % 8],
         "gating_probs": [0.6, 0.4], "token_idx": t}
        for p in problems for l in range(layers) for t in range(tokens)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_load_detects_csv_and_jsonl(tmp_path):
    write_csv(tmp_path / "prompt_1_data.csv", [("a", "0, 1"), ("b", "2, 3")])
    assert load_trace(tmp_path / "prompt_1_data.csv").meta.model == "deepseek-v2-lite"
    assert load_trace(tmp_path).num_requests == 1  # a folder of CSVs
    (tmp_path / "prompt_1_data.csv").rename(tmp_path / "data.txt")
    assert load_trace(tmp_path / "data.txt").num_tokens == 2  # sniffed from the header
    write_jsonl(tmp_path / "r.jsonl")
    assert load_trace(tmp_path / "r.jsonl").meta.model == "mixtral-8x7b"


def test_jsonl_folder_prefers_routing_files(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "gsm8k_2_routing.jsonl", problems=(0, 1))
    write_jsonl(tmp_path / "raw.jsonl", dataset="gsm8k", problems=(0,), tokens=5)  # would clash if read
    (tmp_path / "data" / "gsm8k_2_outputs.jsonl").write_text('{"problem_id": 0, "prompt": "x"}\n')
    trace = load_trace(tmp_path)
    assert trace.num_requests == 2 and trace.meta.extra["request_names"] == ["gsm8k/0", "gsm8k/1"]


def test_folder_errors(tmp_path):
    with pytest.raises(TraceError, match="no .csv or .jsonl trace files under"):
        load_trace(tmp_path)
    write_csv(tmp_path / "prompt_1_data.csv", [("a", "0, 1")])
    write_jsonl(tmp_path / "r.jsonl")
    with pytest.raises(TraceError, match="both .csv and .jsonl"):
        load_trace(tmp_path)

"""Importers: MoE-Beyond CSV (fast path vs reference parser) and Mixtral JSONL, small and real files.

Run: .venv/bin/pytest tests/trace/test_importers.py -q
(real-trace tests skip without shared/data/traces; the full DeepSeek import is `-m slow`)
"""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqmoe.trace._moe_beyond import HEADER, parse_fast, parse_reference
from seqmoe.trace.importers import import_mixtral_jsonl, import_moe_beyond_csv, natural_key
from seqmoe.trace.schema import TraceError


def csv_bytes(tokens: list[str], ids: np.ndarray, layer_ids=None, eol: str = "\r\n") -> bytes:
    """A MoE-Beyond CSV as Python's csv module writes it; ids: [T, L, K]."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator=eol)
    w.writerow(HEADER.split(","))
    T, L, _ = ids.shape
    for l in range(L):
        for t in range(T):
            layer = l + 1 if layer_ids is None else layer_ids[l]
            w.writerow([layer, 0, tokens[t], "[" + ", ".join(map(str, ids[t, l])) + "]"])
    return buf.getvalue().encode("utf-8")


TOKENS = ["<｜begin▁of▁sentence｜>", ",", '"', 'a,"b', "Ġx", "[1, 2]", ""]
IDS = np.arange(7 * 2 * 3).reshape(7, 2, 3) % 64  # [T=7, L=2, K=3], distinct within a row


def test_natural_order():
    names = ["prompt_10_data.csv", "prompt_2_data.csv", "prompt_1_data.csv"]
    assert sorted(names, key=natural_key) == ["prompt_1_data.csv", "prompt_2_data.csv", "prompt_10_data.csv"]


def test_csv_folder(tmp_path):
    (tmp_path / "prompt_10_data.csv").write_bytes(csv_bytes(["x", "y"], IDS[:2] + 1))
    (tmp_path / "prompt_2_data.csv").write_bytes(csv_bytes(TOKENS, IDS))
    trace = import_moe_beyond_csv(tmp_path)
    assert trace.meta.extra["request_names"] == ["prompt_2_data.csv", "prompt_10_data.csv"]
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts) == (9, 2, 3, 64)
    assert trace.expert_ids.dtype == np.int16 and trace.token_ids.dtype == np.int32
    np.testing.assert_array_equal(trace.expert_ids[:7], IDS)
    np.testing.assert_array_equal(trace.expert_ids[7:], IDS[:2] + 1)
    assert trace.request_offsets.tolist() == [0, 7, 9]
    assert trace.vocab == (*TOKENS, "x", "y")
    assert [trace.vocab[i] for i in trace.token_ids] == TOKENS + ["x", "y"]
    assert trace.meta.model == "deepseek-v2-lite"


def test_csv_single_file_lf_and_no_final_newline(tmp_path):
    data = csv_bytes(["a", "b", "a"], IDS[:3], eol="\n").rstrip(b"\n")
    (tmp_path / "p.csv").write_bytes(data)
    trace = import_moe_beyond_csv(tmp_path / "p.csv", num_experts=32)
    assert trace.num_experts == 32 and trace.vocab == ("a", "b") and trace.token_ids.tolist() == [0, 1, 0]
    assert parse_fast(data, 32) is not None  # well-formed files take the fast path


def _lines(tokens=("a", "b", "c"), layers=2) -> list[str]:
    data = csv_bytes(list(tokens), IDS[: len(tokens), :layers] % 8)
    return data.decode().split("\r\n")[:-1]


def _edit(lines: list[str], line: int, text: str) -> list[str]:
    out = list(lines)
    out[line - 1] = text
    return out


# (lines of the file, expected message). Rows: line 2..4 layer 1, line 5..7 layer 2.
BAD_FILES = {
    "header": (_edit(_lines(), 1, "Layer,Batch,Token,Experts"), r":1: wrong header 'Layer,Batch,Token,Experts'"),
    "no rows": ([HEADER], r"p.csv: no data rows"),
    "unequal rows": (_lines()[:-1], r"p.csv:5: layer 2 has 2 rows but layer 1 has 3"),
    "non-integer": (_edit(_lines(), 3, '1,0,b,"[1, x, 3]"'), r"p.csv:3: expert ids must be integers, got \[1, x, 3\]"),
    "signed id": (_edit(_lines(), 3, '1,0,b,"[1, +2, 3]"'), r"p.csv:3: expert ids must be integers"),
    "out of range": (_edit(_lines(), 6, '2,0,b,"[1, 64, 3]"'), r"p.csv:6: expert id 64 out of range \[0, 64\)"),
    "too few ids": (_edit(_lines(), 4, '1,0,c,"[1, 2]"'), r"p.csv:4: 2 expert ids, but line 2 has 3"),
    "too many ids": (_edit(_lines(), 7, '2,0,c,"[1, 2, 3, 4]"'), r"p.csv:7: 4 expert ids, but line 2 has 3"),
    "empty ids": (_edit(_lines(), 2, '1,0,a,"[]"'), r"p.csv:2: expert ids must be integers"),
    "double comma": (_edit(_lines(), 2, '1,0,a,"[1,, 2]"'), r"p.csv:2: expert ids must be integers"),
    "duplicate id": (_edit(_lines(), 5, '2,0,a,"[5, 6, 5]"'), r"p.csv:5: an expert id appears twice"),
    "layer gap": ([ln.replace("2,0,", "3,0,", 1) if i >= 4 else ln for i, ln in enumerate(_lines())],
                  r"p.csv:5: layer id 3 after layer 1; layer ids must run 1, 2, ..., L"),  # fmt: skip
    "starts at 0": ([ln.replace("1,0,", "0,0,", 1) if 1 <= i <= 3 else ln for i, ln in enumerate(_lines())],
                    r"p.csv:2: layer id 0 as the first layer"),  # fmt: skip
    "interleaved": (_edit(_lines(), 6, '1,0,b,"[1, 2, 3]"'), r"p.csv:6: layer id 1 after layer 2"),
    "token differs": (_edit(_lines(), 6, '2,0,z,"[1, 2, 3]"'), r"p.csv:6: token 'z' differs from layer 1's token 'b'"),
    "bad quoting": (_edit(_lines(), 3, '1,0,b"c,"[1, 2, 3]"'), r"p.csv:3: malformed row"),
    "unquoted comma": (_edit(_lines(), 3, '1,0,b,c,"[1, 2, 3]"'), r"p.csv:3: malformed row"),
    "layer not int": (_edit(_lines(), 2, 'one,0,a,"[1, 2, 3]"'), r"p.csv:2: layer id and batch number must be"),
    "blank line": (_edit(_lines(), 4, ""), r"p.csv:4: malformed row ''"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_csv_errors_name_file_and_line(tmp_path, case):
    lines, message = BAD_FILES[case]
    data = ("\r\n".join(lines) + "\r\n").encode()
    assert parse_fast(data, 64) is None, "the fast path must leave malformed files to the reference"
    (tmp_path / "p.csv").write_bytes(data)
    with pytest.raises(TraceError, match=message):
        import_moe_beyond_csv(tmp_path / "p.csv")


def test_csv_not_utf8(tmp_path):
    (tmp_path / "p.csv").write_bytes(HEADER.encode() + b'\r\n1,0,\xff,"[1]"\r\n')
    with pytest.raises(TraceError, match="p.csv: not UTF-8"):
        import_moe_beyond_csv(tmp_path / "p.csv")


def test_csv_files_must_agree_on_shape(tmp_path):
    (tmp_path / "prompt_1_data.csv").write_bytes(csv_bytes(["a"], IDS[:1]))
    (tmp_path / "prompt_2_data.csv").write_bytes(csv_bytes(["a"], IDS[:1, :1]))
    message = "prompt_2_data.csv: 1 layers x 3 experts per token, but prompt_1_data.csv has 2 x 3"
    with pytest.raises(TraceError, match=message):
        import_moe_beyond_csv(tmp_path)


def test_csv_missing_and_empty_folder(tmp_path):
    with pytest.raises(TraceError, match="no such file or folder"):
        import_moe_beyond_csv(tmp_path / "nope")
    with pytest.raises(TraceError, match="no .csv files under"):
        import_moe_beyond_csv(tmp_path)


_TOKEN_CHARS = st.sampled_from(list('ab,"[] 1Ġé\r'))
_MUTANT_CHARS = st.sampled_from([*'0123456789,"[] \n\r\t+-ax', '\0'])


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    T=st.integers(1, 4),
    L=st.integers(1, 3),
    K=st.integers(1, 3),
    eol=st.sampled_from(["\r\n", "\n"]),
)
def test_fast_path_agrees_with_reference(data, T, L, K, eol):
    """On random well-formed and mutated files, the fast path is exact or steps aside."""
    tokens = [data.draw(st.text(_TOKEN_CHARS, max_size=4)) for _ in range(T)]
    rng = np.random.default_rng(T * 100 + L * 10 + K)
    ids = np.array([[rng.permutation(12)[:K] for _ in range(L)] for _ in range(T)])  # [T, L, K] distinct per row
    raw = bytearray(csv_bytes(tokens, ids, eol=eol))
    mutate = data.draw(st.booleans())
    if mutate:
        pos = data.draw(st.integers(len(HEADER) + 1, len(raw) - 1))
        op = data.draw(st.sampled_from(["replace", "insert", "delete"]))
        char = data.draw(_MUTANT_CHARS).encode()
        raw[pos : pos + (op != "insert")] = b"" if op == "delete" else char
    raw = bytes(raw)
    fast = parse_fast(raw, 12)
    if not mutate and K > 1:  # a single id is written without quotes: left to the reference
        assert fast is not None
    try:
        ref = parse_reference(raw, "f.csv", 12)
    except TraceError:
        assert fast is None, "fast path accepted a file the reference rejects"
        return
    if fast is not None:
        np.testing.assert_array_equal(fast.expert_ids, ref.expert_ids)
        assert fast.expert_ids.dtype == ref.expert_ids.dtype == np.int16
        assert fast.tokens == ref.tokens


# ----------------------------------------------------------------------------- Mixtral JSONL


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rec(dataset="gsm8k", problem=0, layer=0, experts=(1, 2), probs=(0.7, 0.3), t=0):
    return {"dataset": dataset, "problem_id": problem, "layer": layer, "experts": list(experts),
            "gating_probs": list(probs), "token_idx": t}  # fmt: skip


def test_jsonl_basic(tmp_path):
    records = [
        rec(problem=p, layer=l, experts=(l, p + 4), probs=(0.6, 0.4), t=t)
        for p in (1, 0)
        for l in range(3)
        for t in range(2 + p)
    ]
    trace = import_mixtral_jsonl(jsonl(tmp_path / "r.jsonl", records))
    assert trace.meta.extra["request_names"] == ["gsm8k/1", "gsm8k/0"]  # order of first appearance
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts) == (5, 3, 2, 8)
    assert trace.request_offsets.tolist() == [0, 3, 5]
    assert trace.expert_ids[0].tolist() == [[0, 5], [1, 5], [2, 5]]
    assert trace.gate_weights.dtype == np.float32 and np.allclose(trace.gate_weights, [0.6, 0.4])
    assert trace.meta.extra["dropped_rows"] == 0


def test_jsonl_unequal_layers_truncated_with_warning(tmp_path):
    counts = {0: 4, 1: 3, 2: 5}
    records = [rec(layer=l, experts=(t % 8, (t + 1) % 8), t=t) for l, n in counts.items() for t in range(n)]
    with pytest.warns(UserWarning, match="3 routing rows dropped"):
        trace = import_mixtral_jsonl(jsonl(tmp_path / "r.jsonl", records))
    assert trace.num_tokens == 3 and trace.meta.extra["dropped_rows_per_request"] == [3]
    assert trace.expert_ids[:, 2, 0].tolist() == [0, 1, 2]  # rows in file order, tail cut


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"dataset": "gsm8k", "problem_id": 0, "layer": 0,', r"r.jsonl:2: malformed JSON"),
        ("[1, 2]", r"r.jsonl:2: expected a JSON object per line"),
        ('{"dataset": "x", "problem_id": 0, "layer": 0, "experts": [1, 2]}', r"r.jsonl:2: record lacks gating_probs"),
        (json.dumps(rec(experts=(1, 9))), r"r.jsonl:2: expert id 9 out of range \[0, 8\)"),
        (json.dumps(rec(experts=(3, 3))), r"r.jsonl:2: an expert appears twice"),
        (json.dumps(rec(experts=(1, 2, 3), probs=(0.5, 0.3, 0.2))), r"r.jsonl:2: 3 experts, but earlier records"),
        (json.dumps(rec(probs=(1.0,))), r"r.jsonl:2: gating_probs must be 2 numbers"),
        (json.dumps(rec(layer=-1)), r"r.jsonl:2: layer must be a non-negative integer"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    (tmp_path / "r.jsonl").write_text(json.dumps(rec()) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message):
        import_mixtral_jsonl(tmp_path / "r.jsonl")


def test_jsonl_request_errors(tmp_path):
    with pytest.raises(TraceError, match="request gsm8k/0 has no records for layer 1 "):
        import_mixtral_jsonl(jsonl(tmp_path / "a.jsonl", [rec(layer=0), rec(layer=2)]))
    a, b = jsonl(tmp_path / "a.jsonl", [rec()]), jsonl(tmp_path / "b.jsonl", [rec()])
    with pytest.raises(TraceError, match="b.jsonl:1: request gsm8k/0 also appears in .*a.jsonl"):
        import_mixtral_jsonl([a, b])
    with pytest.raises(TraceError, match="no routing records"):
        import_mixtral_jsonl(jsonl(tmp_path / "e.jsonl", []))
    with pytest.raises(TraceError, match="no such file"):
        import_mixtral_jsonl(tmp_path / "nope.jsonl")


# ----------------------------------------------------------------------------- real traces


def test_real_deepseek_csv_slice(shared_traces, tmp_path):
    puffin = shared_traces / "deepseek-v2-lite-puffin" / "puffin"
    for n in (10, 2, 1):  # links, not copies: the data stays outside the repository
        (tmp_path / f"prompt_{n}_data.csv").symlink_to(puffin / f"prompt_{n}_data.csv")
    trace = import_moe_beyond_csv(tmp_path)
    assert (trace.num_layers, trace.top_k, trace.num_experts, trace.num_requests) == (26, 6, 64, 3)
    assert trace.meta.extra["request_names"] == ["prompt_1_data.csv", "prompt_2_data.csv", "prompt_10_data.csv"]
    assert trace.vocab[trace.token_ids[0]] == "<｜begin▁of▁sentence｜>"
    for r, n in enumerate((1, 2, 10)):
        ref = parse_reference((puffin / f"prompt_{n}_data.csv").read_bytes(), "ref", 64)
        lo, hi = trace.request_offsets[r : r + 2]
        np.testing.assert_array_equal(trace.expert_ids[lo:hi], ref.expert_ids)
        assert [trace.vocab[i] for i in trace.token_ids[lo:hi]] == ref.tokens


def test_real_mixtral_folder(shared_traces):
    from seqmoe.trace.io import load_trace

    with pytest.warns(UserWarning, match="rows dropped"):
        trace = load_trace(shared_traces / "mixtral8x7b-speculative-moe")
    assert (trace.num_layers, trace.top_k, trace.num_experts, trace.num_requests) == (32, 2, 8, 4)
    assert trace.meta.extra["request_names"] == ["gsm8k/0", "gsm8k/1", "humaneval/0", "humaneval/1"]
    # 585 decode tokens in the source; each request is cut to its shortest layer (SOURCE.md).
    assert 570 <= trace.num_tokens <= 585
    np.testing.assert_allclose(trace.gate_weights.sum(axis=2), 1.0, atol=1e-3)


@pytest.mark.slow
def test_real_deepseek_full_folder(shared_traces):
    trace = import_moe_beyond_csv(shared_traces / "deepseek-v2-lite-puffin", progress=False)
    assert (trace.num_requests, trace.num_layers, trace.top_k) == (1799, 26, 6)
    assert 150_000 < trace.num_tokens < 200_000

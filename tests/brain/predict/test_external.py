"""Predictions made elsewhere: MoE-Beyond's predicted CSVs matched to the replayed trace, and refused when not of it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqmoe.brain.predict.baselines.external import load_predictions
from seqmoe.cli import main
from seqmoe.trace.io import save_trace
from seqmoe.trace.schema import TraceError
from tests.conftest import make_trace


def _write_csvs(folder, trace, predicted, order):
    """One MoE-Beyond predicted CSV per request, file n holding request order[n - 1]."""
    folder.mkdir()
    off = trace.request_offsets
    for n, r in enumerate(order, start=1):
        lines = ["Layer ID,Token,Activated Expert IDs,Predicted Expert IDs"]
        for layer in range(trace.num_layers):
            for i, t in enumerate(range(off[r], off[r + 1])):
                ids = ", ".join(str(int(e)) for e in trace.expert_ids[t, layer])
                pred = ", ".join(str(int(e)) for e in predicted[t, layer])
                lines.append(f'{layer + 1},{i},"[{ids}]","[{pred}]"')
        (folder / f"prompt_{n}_data_predicted.csv").write_text("\n".join(lines) + "\n")


def test_moe_beyond_files_are_matched_to_the_requests_by_their_routing(tmp_path):
    trace = make_trace(num_tokens=50, num_requests=4, seed=8)
    predicted = (trace.expert_ids.astype(np.int64) + 1) % trace.num_experts
    _write_csvs(tmp_path / "pred", trace, predicted, order=[2, 0, 3, 1])
    assert np.array_equal(load_predictions(tmp_path / "pred", trace), predicted)


def test_files_of_another_trace_or_a_wrong_header_are_refused(tmp_path):
    trace, other = make_trace(num_tokens=50, num_requests=4, seed=8), make_trace(num_tokens=50, num_requests=4, seed=9)
    _write_csvs(tmp_path / "other", other, other.expert_ids, order=[0, 1, 2, 3])
    with pytest.raises(TraceError, match="match no request of the replayed trace"):
        load_predictions(tmp_path / "other", trace)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/prompt_1_data_predicted.csv").write_text("Layer,Token\n1,0\n")
    with pytest.raises(TraceError, match="wrong header"):
        load_predictions(tmp_path / "bad", trace)
    with pytest.raises(TraceError, match="no such predictions"):
        load_predictions(tmp_path / "missing", trace)


def test_eval_predictor_scores_predictions_alone(tmp_path, capsys):
    trace = make_trace(num_tokens=50, num_requests=4, seed=8)
    save_trace(trace, tmp_path / "t.safetensors")
    _write_csvs(tmp_path / "pred", trace, trace.expert_ids, order=[0, 1, 2, 3])
    assert main(["eval-predictor", "--trace", str(tmp_path / "t.safetensors"), "--predictions", str(tmp_path / "pred"),
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["predictors"]["external"]
    assert got["macro_f1"]["1"] == 1.0 and got["accuracy"]["1"] == 1.0 and got["recall_at_k"]["1"] == 1.0

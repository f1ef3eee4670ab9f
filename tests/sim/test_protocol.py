"""Other papers' protocols as replay options: free link, per-request reset, warm-up; external predictions."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from safetensors.numpy import save_file

from seqmoe.base.errors import UserError
from seqmoe.config import SimConfig
from seqmoe.sim.protocol import scored_tokens
from seqmoe.sim.run import load_workload, run_one
from seqmoe.trace.schema import TraceError
from tests.conftest import make_trace, tiny_hardware, tiny_model


def _workload(trace, monkeypatch):
    monkeypatch.setattr("seqmoe.sim.run.get_model_profile", lambda name: tiny_model(trace))
    monkeypatch.setattr("seqmoe.sim.run.get_hardware_profile", lambda name: tiny_hardware())
    cfg = SimConfig(trace="t", train="t")
    return cfg, load_workload(cfg, train=trace, test=trace)


def _reference_lru(trace, capacity: int, warmup: int, predicted=None) -> tuple[int, int]:
    """(hits, scored) of one global LRU emptied at each request, `predicted` sets inserted before each layer; a
    layer's routed experts are looked up together, then its hits touched and its misses inserted."""
    hits = scored = 0
    L, E = trace.num_layers, trace.num_experts
    off = trace.request_offsets
    for r in range(trace.num_requests):
        cache = OrderedDict()

        def touch(uid):
            cache[uid] = None
            cache.move_to_end(uid)
            if len(cache) > capacity:
                cache.popitem(last=False)

        for t in range(off[r], off[r + 1]):
            for layer in range(L):
                for e in ([] if predicted is None else predicted[t, layer]):
                    touch(layer * E + int(e))
                uids = [layer * E + int(e) for e in trace.expert_ids[t, layer]]
                present = [u for u in uids if u in cache]  # a layer's experts are scored together, hits first
                if t - off[r] >= warmup:
                    hits, scored = hits + len(present), scored + len(uids)
                for uid in present + [u for u in uids if u not in present]:
                    touch(uid)
    return hits, scored


def test_scored_tokens_leave_out_each_requests_first_tokens():
    got = scored_tokens(np.array([0, 3, 4, 9]), 2)
    assert got.tolist() == [False, False, True, False, False, False, True, True, True]


def test_lru_with_a_free_link_an_empty_reset_and_warmup_counts_as_the_reference_lru(monkeypatch):
    trace = make_trace(num_tokens=90, num_requests=4, seed=3)
    cfg, w = _workload(trace, monkeypatch)
    row = run_one(w, SimConfig(**(cfg.to_dict() | dict(system="on-demand-lru", residency=0.5, link="free",
                                                        reset="empty", warmup=3))))
    hits, scored = _reference_lru(trace, row["capacity"], 3)
    assert (row["ready"] + row["late"], row["activations"]) == (hits, scored)
    assert row["time_s"] is None and row["tokens_per_s"] is None and "not a time" in row["time_note"]
    assert "belady_misses" not in row  # no bound of a part of the trace


def test_a_random_reset_is_seeded_and_differs_from_carrying_the_pool(monkeypatch):
    trace = make_trace(num_tokens=90, num_requests=6, seed=4)
    cfg, w = _workload(trace, monkeypatch)
    base = cfg.to_dict() | dict(system="on-demand-lru", residency=0.5, link="free")
    rows = [run_one(w, SimConfig(**(base | extra))) for extra in
            (dict(reset="random", seed=1), dict(reset="random", seed=1), dict(reset="random", seed=2), {})]
    assert rows[0]["hit_rate"] == rows[1]["hit_rate"]
    assert len({r["hit_rate"] for r in rows[1:]}) > 1


def _predictions_file(tmp_path, trace, predicted):
    path = tmp_path / "pred.safetensors"
    save_file({"predicted_ids": predicted.astype(np.int64), "request_offsets": trace.request_offsets}, str(path))
    return str(path)


def test_moe_beyond_style_with_true_predictions_hits_every_scored_activation(monkeypatch, tmp_path):
    trace = make_trace(num_tokens=60, num_requests=3, seed=5)
    cfg, w = _workload(trace, monkeypatch)
    path = _predictions_file(tmp_path, trace, trace.expert_ids)
    base = cfg.to_dict() | dict(system="moe-beyond-style", residency=0.3, predictions=path, prediction_lead=0,
                                reset="empty", warmup=1)
    free = run_one(w, SimConfig(**(base | {"link": "free"})))
    assert free["hit_rate"] == 1.0
    priced = run_one(w, SimConfig(**base))
    lru = run_one(w, SimConfig(**(cfg.to_dict() | dict(system="on-demand-lru", residency=0.3, reset="empty",
                                                        warmup=1))))
    assert "too late" in priced["predictions_note"] and priced["hit_rate"] == lru["hit_rate"]


def test_moe_beyond_style_with_noisy_predictions_counts_as_the_reference_rule(monkeypatch, tmp_path):
    trace = make_trace(num_tokens=150, num_requests=5, seed=6)
    cfg, w = _workload(trace, monkeypatch)
    predicted = np.where(np.random.default_rng(0).random(trace.expert_ids.shape) < 0.6, trace.expert_ids,
                         (trace.expert_ids + 1) % trace.num_experts)
    row = run_one(w, SimConfig(**(cfg.to_dict() | dict(system="moe-beyond-style", residency=0.4, link="free",
                                                        reset="empty", warmup=2, prediction_lead=0,
                                                        predictions=_predictions_file(tmp_path, trace, predicted)))))
    hits, scored = _reference_lru(trace, row["capacity"], 2, predicted)
    assert row["activations"] == scored and row["ready"] + row["late"] == hits, (row["ready"] + row["late"], hits)


def test_predictions_of_another_trace_are_refused(monkeypatch, tmp_path):
    trace = make_trace(num_tokens=60, num_requests=3, seed=5)
    cfg, w = _workload(trace, monkeypatch)
    other = make_trace(num_tokens=61, num_requests=3, seed=5)
    with pytest.raises(TraceError, match="must be of the replayed trace"):
        run_one(w, SimConfig(**(cfg.to_dict() | dict(system="moe-beyond-style", link="free", prediction_lead=0,
                                                      predictions=_predictions_file(tmp_path, other, other.expert_ids)))))


@pytest.mark.parametrize("extra, message", [
    (dict(reset="sometimes"), "--reset must be one of"),
    (dict(warmup=-1), "--warmup must be"),
    (dict(link="cheap"), "--link must be one of"),
    (dict(reset="random", batch=2), "replay them at --batch 1"),
    (dict(system="moe-beyond-style"), "give --predictions PATH and --prediction-lead"),
])
def test_protocol_options_are_checked_at_once(extra, message):
    with pytest.raises(UserError, match=message):
        SimConfig(**(dict(trace="t") | extra))


def test_moe_beyond_table_from_the_shared_files(shared_traces):
    """Their protocol on their files: LRU 28.1 % and their predictions 72.4 % (SOURCE.md), within a point."""
    folder = shared_traces / "deepseek-v2-lite-webglm-moe-beyond"
    cfg = SimConfig(trace=str(folder / "routing"), train=str(folder / "routing"), residency=0.1, link="free",
                    reset="random", warmup=10)
    w = load_workload(cfg)
    lru = run_one(w, cfg)
    theirs = run_one(w, SimConfig(**(cfg.to_dict() | dict(system="moe-beyond-style", prediction_lead=0,
                                                           predictions=str(folder / "predicted")))))
    assert abs(lru["hit_rate"] - 0.281) <= 0.01 and lru["capacity"] == 166
    assert abs(theirs["hit_rate"] - 0.724) <= 0.01


def test_belady_under_a_reset_reads_each_requests_own_future(monkeypatch):
    # Each request is replayed alone; an oracle must still find its future at the request's place in the trace.
    trace = make_trace(num_tokens=90, num_requests=4, seed=5)
    cfg, w = _workload(trace, monkeypatch)
    fields = cfg.to_dict() | dict(system="belady", residency=0.3, link="free", reset="empty")

    def misses(test):
        row = run_one(load_workload(cfg, train=trace, test=test), SimConfig(**fields))
        return row["activations"] - row["ready"] - row["late"]

    alone = [misses(trace.select_requests([r])) for r in range(trace.num_requests)]
    assert misses(trace) == sum(alone)

"""The runtime drives the seq2seq forecaster live: `seqmoe` systems decide what `simulate()` decides.

A tiny forecaster is trained for a few seconds on a trace of the tiny OLMoE; the runtime serves
generate requests with it, and replaying `runtime.trace()` with the same system, forecaster
checkpoint, capacity, start and cost model gives the same counts; the tokens and logits stay
the full model's. Run: pytest tests/runtime/test_forecaster.py -q
"""

from __future__ import annotations

import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.brain.predict.drafters import NgramDrafter
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.brain.manager.systems import live_systems
from seqmoe.runtime import offload
from seqmoe.sim import simulate
from seqmoe.brain.manager.systems import SYSTEMS, SystemInputs, build_system
from tests.runtime.conftest import TEST_HW, fresh, greedy, logits, reference

PROMPTS = ([1, 8, 77, 21], [1, 50, 3, 3, 91, 14, 60, 2, 19])
FORECAST_SYSTEMS = [n for n in live_systems(with_predictor=True) if SYSTEMS[n].needs_predictor]


@pytest.fixture(scope="module")
def predictor_dir(tmp_path_factory):
    from seqmoe.brain.predict.train import train_seq_predictor

    out = tmp_path_factory.mktemp("predictor")
    train_seq_predictor(reference("olmoe").train, out, epochs=1, max_minutes=0.1, hash_buckets=64, embed_dim=16,
                        hidden_dim=16, query_dim=16, progress=False)
    return out


def test_forecast_systems_are_live():
    assert {"seqmoe", "seqmoe-greedy-prefetch", "seqmoe-lru-eviction"} <= set(FORECAST_SYSTEMS)
    assert not set(FORECAST_SYSTEMS) & set(live_systems())  # the default list needs no forecaster


@pytest.mark.parametrize("control", ["inline", "thread"])
@pytest.mark.parametrize("system", FORECAST_SYSTEMS)
def test_counts_equal_the_simulators_and_generation_is_exact(system, predictor_dir, control):
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, system, train=ref.train, predictor=str(predictor_dir), hardware=TEST_HW, control=control)
    outs = [greedy(model, p, 6) for p in PROMPTS]
    assert (logits(model) - ref.logits).abs().max().item() <= 1e-5
    trace = rt.trace()
    s = rt.stats()
    far = rt.controller.system.predictor.far
    rt.restore()
    for p, out in zip(PROMPTS, outs):
        assert torch.equal(out, greedy(ref.model, p, 6))
    assert trace.num_requests == 3 and trace.token_ids is not None and trace.vocab is None
    replay = build_system(system, SystemInputs(train=ref.train, test=trace, capacity=rt.capacity,
                                               start=tuple(rt.start), predictor=load_seq_predictor(predictor_dir)),
                          rt.miss)
    c = simulate(trace, replay, model=rt.model_profile, hardware=rt.hardware, capacity=rt.capacity, start=rt.start)
    got = (s["ready"], s["late"], s["misses"], s["prefetches"], s["wasted_copies"], s["cancelled_prefetches"])
    assert got == (c.ready, c.late, c.misses, c.prefetches, c.wasted_copies, c.cancelled)
    assert s["sim_time_s"] == pytest.approx(c.time_s, rel=1e-12)
    # The forecaster drove prefetches; with its long-range head (the current token forecast, this
    # model's few layers) it may not, and the head's values reached the policy instead.
    assert s["prefetches"] > 0 or far is not None


def test_drafted_look_ahead_live_equals_the_simulators(predictor_dir):
    """With n-gram drafts the live counts still equal the simulator's replay with the same drafter, and
    generation stays exact."""
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "seqmoe", train=ref.train, predictor=str(predictor_dir), hardware=TEST_HW, draft="ngram")
    outs = [greedy(model, p, 6) for p in PROMPTS]
    drafter = rt.controller.system.predictor.drafter
    trace, s = rt.trace(), rt.stats()
    rt.restore()
    for p, out in zip(PROMPTS, outs):
        assert torch.equal(out, greedy(ref.model, p, 6))
    assert drafter.tries.sum() > NgramDrafter().fit(ref.train).tries.sum()  # it guessed live
    replay = build_system("seqmoe", SystemInputs(train=ref.train, test=trace, capacity=rt.capacity, start=tuple(rt.start),
                                                 predictor=load_seq_predictor(predictor_dir), draft="ngram"), rt.miss)
    c = simulate(trace, replay, model=rt.model_profile, hardware=rt.hardware, capacity=rt.capacity, start=rt.start)
    assert (s["ready"], s["late"], s["misses"], s["prefetches"]) == (c.ready, c.late, c.misses, c.prefetches)
    assert s["sim_time_s"] == pytest.approx(c.time_s, rel=1e-12)


def test_token_ids_reach_the_forecaster_as_simulate_passes_them(predictor_dir):
    """Live, the forecaster hashes the input ids directly; on the recorded trace (ids, no vocab) the
    bucket table gives the same buckets; and the ids it is fed are the trace's, request starts included."""
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "seqmoe", train=ref.train, predictor=load_seq_predictor(predictor_dir), hardware=TEST_HW)
    pred = rt.controller.system.predictor  # the system's own forecaster (with the manager's window)
    seen: list = []
    begin_token, begin_request = pred.begin_token, pred.begin_request
    pred.begin_token = lambda step, tok: (seen.append((step, tok)), begin_token(step, tok))[1]
    pred.begin_request = lambda: (seen.append("request"), begin_request())[1]
    assert pred._table is None  # bound to the placeholder: no vocabulary
    live = [pred._bucket(t) for t in range(128)]
    for p in PROMPTS:
        greedy(model, p, 4)
    trace = rt.trace()
    rt.restore()
    L = trace.num_layers
    starts = set(trace.request_offsets[:-1].tolist())
    want = []
    for t, tok in enumerate(trace.token_ids.tolist()):
        want += ["request"] * (t in starts) + [(t * L, tok)]
    assert seen == want
    pred.check_trace(trace)
    assert [pred._bucket(t) for t in range(int(trace.token_ids.max()) + 1)] == live[:int(trace.token_ids.max()) + 1]


def test_predictor_errors(predictor_dir, tmp_path):
    ref = reference("olmoe")
    rt = offload(fresh("olmoe"), 0.3, "seqmoe", train=ref.train)  # no forecaster given: one is learned online
    assert rt.stats()["forecaster"]["source"] == "new"
    rt.restore()
    with pytest.raises(UserError, match="no predictor folder"):
        offload(fresh("olmoe"), 0.3, "seqmoe", train=ref.train, predictor=tmp_path / "missing")
    with pytest.raises(UserError, match="training trace has L=3, E=8, K=2 but the model has"):
        offload(fresh("qwen2_moe"), 0.5, "seqmoe", train=reference("qwen2_moe").train, predictor=predictor_dir)
    with pytest.raises(UserError, match="checkpoint folder or a SeqPredictor"):
        offload(fresh("olmoe"), 0.3, "seqmoe", train=ref.train, predictor=object())
    model = fresh("olmoe")  # other systems ignore predictor=
    rt = offload(model, 0.3, "on-demand-lru", predictor=predictor_dir)
    assert rt.controller.system.predictor is None
    rt.restore()
    assert torch.isfinite(logits(model)).all()


@pytest.mark.parametrize("system", ["seqmoe", "affinity-style"])
def test_full_residency_skips_planning_with_the_same_counts(system, predictor_dir):
    """With every expert resident from the start the runtime drops the forecaster and the scheduler
    (nothing can be loaded or evicted); the full system replayed by simulate() counts the same."""
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 1.0, system, train=ref.train, predictor=str(predictor_dir), hardware=TEST_HW)
    assert rt.controller.system.prefetcher is None and rt.controller.system.predictor is None
    for p in PROMPTS:
        assert torch.equal(greedy(model, p, 6), greedy(ref.model, p, 6))
    trace, s = rt.trace(), rt.stats()
    rt.restore()
    pred = load_seq_predictor(predictor_dir) if SYSTEMS[system].needs_predictor else None
    replay = build_system(system, SystemInputs(train=ref.train, test=trace, capacity=rt.capacity,
                                               start=tuple(rt.start), predictor=pred), rt.miss)
    assert replay.prefetcher is not None
    c = simulate(trace, replay, model=rt.model_profile, hardware=rt.hardware, capacity=rt.capacity, start=rt.start)
    assert (s["ready"], s["late"], s["misses"], s["prefetches"]) == (c.ready, c.late, c.misses, c.prefetches) == (
        c.ready, 0, 0, 0)
    assert s["sim_time_s"] == pytest.approx(c.time_s, rel=1e-12)


def test_generate_cli_runs_seqmoe_with_a_predictor(predictor_dir, tmp_path, capsys):
    import argparse
    import json

    from seqmoe.cli.runtime import add_runtime_commands
    from seqmoe.trace.io import save_trace
    from tests.arch.collect.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("olmoe", tmp_path / "model")
    save_trace(reference("olmoe").train, tmp_path / "train.safetensors")
    parser = argparse.ArgumentParser(prog="seqmoe")
    add_runtime_commands(parser.add_subparsers(dest="command", required=True))
    argv = ["generate", "--model", str(tmp_path / "model"), "--prompt", "Hello", "--system", "seqmoe", "--residency",
            "0.5", "--train", str(tmp_path / "train.safetensors"), "--predictor", str(predictor_dir),
            "--max-new-tokens", "4", "--device", "cpu", "--json"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert stats["system"] == "seqmoe" and stats["generated_tokens"] == 4
    drop = ("--train", str(tmp_path / "train.safetensors"), "--predictor", str(predictor_dir))
    args = parser.parse_args([a for a in argv if a not in drop])  # neither: the forecaster is learned online
    assert args.func(args) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert stats["system"] == "seqmoe" and stats["forecaster"]["source"] == "new"

"""Pre-gating computed live (`runtime.pregate`): the rows equal what the collector records, and the
systems that fuse them decide what `simulate()` decides on the collected trace."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from seqmoe.arch.collect import collect_trace
from seqmoe.base.errors import UserError
from seqmoe.brain.manager.systems import SystemInputs, build_system
from seqmoe.brain.predict.pregate import pregate_probs
from seqmoe.runtime import offload
from seqmoe.sim import simulate
from tests.runtime.conftest import PROMPT, TEST_HW, TRAIN_REQUESTS, fresh, greedy, reference

ARCH, H = "olmoe", 3


@functools.lru_cache(maxsize=None)
def _train():
    return collect_trace(fresh(ARCH), TRAIN_REQUESTS * 3, mode="decode", new_tokens=6, pregate=H)


@pytest.fixture(scope="module")
def predictor_dir(tmp_path_factory):
    from seqmoe.brain.predict.train import train_seq_predictor

    out = tmp_path_factory.mktemp("pregate-predictor")
    train_seq_predictor(_train(), out, epochs=1, max_minutes=0.1, hash_buckets=64, embed_dim=16, hidden_dim=16,
                        query_dim=16, progress=False)
    return out


def _run(system, predictor=None):
    """(runtime stats, its trace, the routers' rows it computed, the collected trace of the same tokens)."""
    model = fresh(ARCH)
    rt = offload(model, 0.3, system, train=_train(), predictor=predictor, hardware=TEST_HW, miss="copy")
    seen = {}
    pred = rt.controller.system.predictor
    source = pred.pregate_source  # the live rows, read by the PregatePredictor alone or inside the hybrid
    row = source.row
    source.row = lambda step, i=0: seen.setdefault(step, row(step, i))
    try:
        assert torch.equal(greedy(model), reference(ARCH).tokens)
        stats, trace = rt.stats(), rt.trace()
    finally:
        rt.restore()
    collected = collect_trace(fresh(ARCH), [PROMPT], mode="decode", new_tokens=8, pregate=H).head(trace.num_tokens)
    return rt, stats, trace, seen, collected


@pytest.mark.parametrize("system", ["expertflow-style", "expertflow-style-pregate-only", "seqmoe-hybrid"])
def test_live_pregate_decides_what_the_simulator_decides(system, predictor_dir):
    pred = str(predictor_dir) if system == "seqmoe-hybrid" else None
    rt, s, trace, seen, collected = _run(system, pred)
    assert np.array_equal(collected.expert_ids, trace.expert_ids)
    T, L, _, E = collected.pregate_logits.shape
    rows = pregate_probs(collected.pregate_logits.reshape(T * L, H, E), collected.top_k)
    assert seen and all(np.array_equal(r, rows[step], equal_nan=True) for step, r in seen.items())
    from seqmoe.brain.predict.checkpoints import load_seq_predictor

    inputs = SystemInputs(train=_train(), test=collected, capacity=rt.capacity, start=tuple(rt.start),
                          predictor=load_seq_predictor(predictor_dir) if pred else None)
    c = simulate(collected, build_system(system, inputs, "copy"), model=rt.model_profile, hardware=rt.hardware,
                 capacity=rt.capacity, start=rt.start)
    assert (s["ready"], s["late"], s["misses"], s["prefetches"]) == (c.ready, c.late, c.misses, c.prefetches)
    assert s["prefetches"] > 0


def test_pregate_systems_need_its_training_trace_and_inline_control():
    with pytest.raises(UserError, match="--pregate"):
        offload(fresh(ARCH), 0.3, "expertflow-style-pregate-only", train=reference(ARCH).train)
    with pytest.raises(UserError, match="control='inline'"):
        offload(fresh(ARCH), 0.3, "expertflow-style", train=_train(), control="thread")
    rt = offload(fresh(ARCH), 0.3, "on-demand-lru", train=_train())  # reads no pre-gate: no input is kept
    assert rt.controller.pregate is None
    rt.restore()


def test_live_pregate_in_a_batch_gives_each_row_its_own_input():
    """A batch of 4 with a system that fuses pre-gating: each lane's predictor asks for its own row of
    the forward, whose pre-gate row is that sequence's (the batch's tokens stay the full model's)."""
    from tests.runtime.test_batched import PROMPTS, generate_batch

    full = generate_batch(reference(ARCH).model)
    model = fresh(ARCH)
    rt = offload(model, 0.3, "expertflow-style", train=_train(), hardware=TEST_HW, miss="copy")
    source = rt.controller.system.predictor.pregate_source
    row, asked = source.row, []
    source.row = lambda step, i=0: asked.append((i, source._rows)) or row(step, i)
    try:
        got = generate_batch(model)
    finally:
        rt.restore()
    assert torch.equal(got, full)
    assert {i for i, rows in asked if rows == len(PROMPTS)} == set(range(len(PROMPTS)))

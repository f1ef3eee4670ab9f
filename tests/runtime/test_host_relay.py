"""The host CPU path inside a posted decode step (`control="thread"`, `host_relay`): exact outputs
and no wait left hanging when a step is cut short or a host job fails (the simulator's counts:
`test_host_path.test_host_path_counts_equal_the_simulators`)."""

from __future__ import annotations

import time

import pytest
import torch

from seqmoe.runtime import DecodeGraph, offload
from tests.arch.collect.tiny_models import ARCHS
from tests.runtime.conftest import PROMPT, fresh, greedy, reference, run_interpreted
from tests.runtime.test_host_path import HOST_HW, RUNS, _decode, _full
from tests.runtime.test_interrupts import _interrupt_at


def _offload(arch: str, system: str = "on-demand-lru", miss: str = "cpu"):
    model = fresh(arch)
    return model, offload(model, 0.3, system, train=reference(arch).train, hardware=HOST_HW, miss=miss,
                          control="thread")


@pytest.mark.parametrize("arch", ARCHS)
def test_posted_steps_with_host_experts_are_exact(arch):
    tokens, step_logits = _full(arch)
    for system, miss in RUNS:
        model, rt = _offload(arch, system, miss)
        try:
            got, got_logits = _decode(model)
            relayed = rt.controller.relay.experts
        finally:
            rt.restore()
        assert torch.equal(got, tokens), f"{arch} {system} {miss}"
        diff = (got_logits - step_logits).abs().max().item()
        assert diff <= 1e-5, f"{arch} {system} {miss}: logits differ by {diff}"
        assert relayed > 0, f"{arch} {system} {miss}: no decode-step expert ran on the host"


@pytest.mark.parametrize("where", ["router", "experts"])
def test_a_cut_step_leaves_no_host_job_waiting(where):
    """Ctrl-C inside a posted step (after a layer's routing posted, or before the last layer's
    experts posted their hidden state): the next generate is exact and does not wait on a stale job."""
    ref = reference("olmoe")
    model, rt = _offload("olmoe", "cpu-all")  # every layer of every step has host jobs
    greedy(model)
    undo = _interrupt_at(where, rt, model, n=4)
    with pytest.raises(KeyboardInterrupt):
        greedy(model, prompt=[1, *range(30, 50)], new_tokens=30)
    undo()
    t0 = time.perf_counter()
    assert torch.equal(greedy(model), ref.tokens)
    assert time.perf_counter() - t0 < 5
    relay = rt.controller.relay
    assert relay.error is None and relay.dropped_jobs == 1  # the cut layer's job: its hidden state never came
    rt.restore()
    assert torch.equal(greedy(model), ref.tokens)


def test_a_failing_host_job_raises_in_the_step_and_restore_still_works(monkeypatch):
    model, rt = _offload("olmoe", miss="cpu")
    greedy(model)

    compute = rt.host.compute

    def broken(*args):
        if args[4].shape[0] > 1:  # a prompt's host experts (computed inline): only the decode relay's jobs fail
            return compute(*args)
        raise ValueError("host expert failed")

    monkeypatch.setattr(rt.host, "compute", broken)
    with pytest.raises(RuntimeError, match="host path stopped"):
        greedy(model, prompt=[1, *range(30, 50)], new_tokens=30)
    t0 = time.perf_counter()
    rt.restore()
    assert time.perf_counter() - t0 < 5
    assert torch.equal(greedy(model), reference("olmoe").tokens)


def test_decode_graph_on_the_cpu_runs_the_host_path():
    model, rt = _offload("olmoe", miss="auto")
    try:
        out = DecodeGraph(rt, 64).generate(torch.tensor([PROMPT]), 8)
        relayed = rt.controller.relay.experts
    finally:
        rt.restore()
    assert torch.equal(out, reference("olmoe").tokens) and relayed > 0


def test_the_device_side_under_the_triton_interpreter():
    """The kernels a CUDA step waits in (`kernels.relay`), run on the CPU: late, missing and aborted
    answers, and whole posted steps exact through them (`relay_interp_check`)."""
    run_interpreted("tests.runtime.relay_interp_check")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("miss", ["cpu", "auto"])
def test_a_captured_cuda_step_runs_the_host_path_exactly(miss):
    """The host path in CUDA posted steps, eager and captured: the host computes its experts in fp32
    while the device waits in `kernels.relay`'s kernels. Greedy tokens equal the full model's on the
    GPU; logits within 1e-4 (fp32, different kernels)."""
    from seqmoe.runtime.kernels import relay as relay_kernels

    if not relay_kernels.available():
        pytest.skip("no triton with tl.atomic_load")

    def decode(model):
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=16, do_sample=False,
                                 num_beams=1, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    want, want_logits = decode(fresh("olmoe").cuda())
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=reference("olmoe").train, device="cuda", hardware=HOST_HW,
                 miss=miss, control="thread")
    try:
        got, got_logits = decode(model)
        dg = DecodeGraph(rt, 64)
        graphed, again = (dg.generate(torch.tensor([PROMPT], device="cuda"), 16) for _ in range(2))
        relay = rt.controller.relay
        assert dg.graph is not None and relay.kernels is not None
        assert relay.experts > 0 and relay.fallbacks == 0
    finally:
        rt.restore()
    assert torch.equal(got, want) and torch.equal(graphed, want) and torch.equal(again, want)
    assert (got_logits - want_logits).abs().max().item() <= 1e-4

"""Misses computed on the host CPU (`miss="cpu"`, `"auto"`): the offloaded model still computes what
the full model computes, for every architecture (greedy tokens equal, each decode step's logits
within 1e-5 in fp32; only the order of one sum differs)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.brain.manager.systems import SystemInputs, build_system
from seqmoe.runtime import offload
from seqmoe.sim import simulate
from tests.arch.collect.tiny_models import ARCHS
from tests.runtime.conftest import PROMPT, TEST_HW, fresh, reference

# The host computes an expert in about half a copy's time: auto sends some misses each way.
HOST_HW = dataclasses.replace(TEST_HW, name="test-hw-host", host_memory_bytes_per_s=3.25e9, host_cores=64)
RUNS = [("on-demand-lru", "cpu"), ("on-demand-lru", "auto"), ("seqmoe-prior-eviction", "auto"),
        ("static-split-style", "copy"), ("cpu-all", "copy")]


def _decode(model, new_tokens: int = 8):
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@functools.lru_cache(maxsize=None)
def _full(arch: str):
    return _decode(reference(arch).model)


@pytest.mark.parametrize("arch", ARCHS)
def test_host_computed_misses_are_exact(arch):
    tokens, step_logits = _full(arch)
    for system, miss in RUNS:
        model = fresh(arch)
        rt = offload(model, 0.3, system, train=reference(arch).train, hardware=HOST_HW, miss=miss)
        try:
            got, got_logits = _decode(model)
            s = rt.stats()
        finally:
            rt.restore()
        assert torch.equal(got, tokens), f"{arch} {system} {miss}"
        diff = (got_logits - step_logits).abs().max().item()
        assert diff <= 1e-5, f"{arch} {system} {miss}: logits differ by {diff}"
        assert s["misses_cpu"] > 0 and rt.host.experts > 0, f"{arch} {system} {miss}: no expert ran on the host"
        if system == "cpu-all":
            assert s["misses_cpu"] == s["activations"] and s["sim_copies"] == 0


def test_host_path_needs_a_host_and_a_known_path():
    with pytest.raises(UserError, match="describes no host"):
        offload(fresh("mixtral"), 0.3, "on-demand-lru", hardware=TEST_HW, miss="cpu")
    with pytest.raises(UserError, match="unknown miss path"):
        offload(fresh("mixtral"), 0.3, "on-demand-lru", miss="gpu")


@pytest.mark.parametrize("control", ["inline", "thread"])  # thread: the posted step's host path (`host_relay`)
@pytest.mark.parametrize(("system", "miss"), RUNS)
def test_host_path_counts_equal_the_simulators(system, miss, control):
    """Replaying the runtime's trace with `simulate` (same system, miss path, cost model) gives the same counts."""
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, system, train=ref.train, hardware=HOST_HW, miss=miss, control=control)
    try:
        _decode(model)
        s = rt.stats()
        trace = rt.trace()
    finally:
        rt.restore()
    sysobj = build_system(system, SystemInputs(train=ref.train, test=trace, capacity=rt.capacity,
                                               start=tuple(rt.start)), miss)
    c = simulate(trace, sysobj, model=rt.model_profile, hardware=rt.hardware, capacity=rt.capacity, start=rt.start)
    assert (s["ready"], s["late"], s["misses"], s["misses_cpu"], s["misses_in_place"], s["sim_copies"]) == (
        c.ready, c.late, c.misses, c.host, c.in_place, c.copies)
    assert s["sim_time_s"] == pytest.approx(c.time_s, rel=1e-12)


def test_the_default_miss_is_auto_inline_and_copy_in_a_posted_step():
    for control, miss in (("inline", "auto"), ("thread", "copy")):
        rt = offload(fresh("olmoe"), 0.3, "on-demand-lru", control=control)
        try:
            assert rt.miss == rt.stats()["miss"] == miss, control
        finally:
            rt.restore()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["olmoe", "mixtral"])
def test_host_computed_misses_are_exact_on_cuda(arch):
    """Inline control on CUDA: the host computes its experts in fp32 on the CPU, the device the rest;
    greedy tokens equal the full model's on the GPU, logits within 1e-4 (fp32, different kernels)."""
    def decode(model):
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=8, do_sample=False,
                                 num_beams=1, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        return out.sequences.cpu(), torch.stack(out.logits).cpu()

    tokens, logits = decode(fresh(arch).cuda())
    model = fresh(arch)
    rt = offload(model, 0.3, "on-demand-lru", train=reference(arch).train, device="cuda", hardware=HOST_HW,
                 miss="cpu", control="inline")
    try:
        got, got_logits = decode(model)
        experts = rt.host.experts
    finally:
        rt.restore()
    assert torch.equal(got, tokens) and experts > 0
    assert (got_logits - logits).abs().max().item() <= 1e-4

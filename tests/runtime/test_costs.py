"""The cost table measured at start (`runtime.costs`, `offload(..., hardware="measured")`)."""

from __future__ import annotations

import pytest
import torch

from seqmoe.config import DEFAULT_HARDWARE
from seqmoe.base.errors import UserError
from seqmoe.costs.host_cost import host_expert_time_s
from seqmoe.costs.profiles import ModelProfile, copy_time_s, get_hardware_profile
from seqmoe.runtime import offload
from seqmoe.runtime.core.costs import measure_link, measured_profile
from tests.runtime.conftest import TEST_HW, fresh, reference


def test_the_measured_profile_prices_a_copy_and_a_host_expert_as_measured():
    mp = ModelProfile(name="m", num_layers=2, num_experts=4, top_k=2, expert_bytes=3_000_000)
    hw = measured_profile(get_hardware_profile(DEFAULT_HARDWARE), mp.expert_bytes, (6e9, 2e-5), 4e-4)
    assert copy_time_s(mp, hw) == pytest.approx(2e-5 + 3e6 / 6e9)
    assert host_expert_time_s(mp, hw) == pytest.approx(4e-4)
    base = get_hardware_profile(DEFAULT_HARDWARE)
    assert (hw.hbm_bytes_per_s, hw.device_memory_bytes) == (base.hbm_bytes_per_s, base.device_memory_bytes)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_measure_link_gives_a_rate_and_an_overhead(device):
    row = torch.zeros(1 << 20, dtype=torch.bfloat16, pin_memory=device == "cuda")
    rate, overhead = measure_link(row, torch.device(device))
    assert rate > 1e8 and 0.0 <= overhead < 1e-2


def test_host_paths_measure_by_default_and_copies_keep_the_preset():
    ref = reference("olmoe")
    for miss, measured in (("auto", True), ("copy", False)):
        model = fresh("olmoe")
        rt = offload(model, 0.3, "on-demand-lru", miss=miss)
        try:
            hw = rt.hardware
        finally:
            rt.restore()
        assert ("measured" in hw.name) == measured, miss
        assert measured or hw == get_hardware_profile(DEFAULT_HARDWARE)
        assert not measured or host_expert_time_s(rt.model_profile, hw) > 0
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, hardware="measured")
    assert "measured" in rt.hardware.name
    rt.restore()


def test_a_measured_link_refuses_an_emulated_or_given_one():
    for kwargs in (dict(bandwidth=1e9), dict(emulate_link=True)):
        model = fresh("olmoe")
        before = {n: p.clone() for n, p in model.named_parameters()}
        with pytest.raises(UserError, match="measured cost model"):
            offload(model, 0.3, "on-demand-lru", miss="auto", **kwargs)
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # nothing changed
    rt = offload(fresh("olmoe"), 0.3, "on-demand-lru", miss="auto", hardware=TEST_HW, bandwidth=1e9)
    assert rt.hardware.h2d_bytes_per_s == 1e9
    rt.restore()

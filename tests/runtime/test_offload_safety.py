"""`offload()` is all-or-nothing: a failure at any step leaves the model exactly as it was; the device's
free memory is checked first; bad residency types are user errors.

Run: pytest tests/runtime/test_offload_safety.py -q
"""

from __future__ import annotations

import threading

import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.runtime import offload
from seqmoe.runtime.core.device import memory_shortfall
from seqmoe.runtime.core.pool import ExpertPool
from tests.runtime.conftest import fresh, greedy, reference


def _state(model) -> dict:
    """Everything `offload` may touch: each parameter (object, values, device, dtype, requires_grad),
    each buffer, the experts modules, the hooks and the forward."""
    params = {n: (id(p), p.detach().clone(), p.device, p.dtype, p.requires_grad) for n, p in model.named_parameters()}
    buffers = {n: (b.clone(), b.device) for n, b in model.named_buffers()}
    experts = {n: id(m) for n, m in model.named_modules() if n.endswith(".experts")}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return {"params": params, "buffers": buffers, "experts": experts, "hooks": hooks,
            "forward": "forward" in model.__dict__, "runtime": hasattr(model, "_seqmoe_runtime")}


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    assert before["params"].keys() == after["params"].keys()
    for n, (pid, value, device, dtype, grad) in before["params"].items():
        pid2, value2, device2, dtype2, grad2 = after["params"][n]
        assert (pid, device, dtype, grad) == (pid2, device2, dtype2, grad2), n
        assert torch.equal(value, value2), n
    for n, (value, device) in before["buffers"].items():
        assert after["buffers"][n][1] == device and torch.equal(after["buffers"][n][0], value), n
    assert (before["experts"], before["hooks"], before["forward"], before["runtime"]) == \
        (after["experts"], after["hooks"], after["forward"], after["runtime"])


def _seqmoe_threads() -> int:
    return sum(t.name.startswith("seqmoe-") and t.is_alive() for t in threading.enumerate())


def _still_works(model, arch: str) -> None:
    assert torch.equal(greedy(model), reference(arch).tokens)
    rt = offload(model, 0.5, "on-demand-lru", train=reference(arch).train)  # and a new offload is accepted
    assert torch.equal(greedy(model), reference(arch).tokens)
    rt.restore()


def test_out_of_memory_at_pool_allocation_leaves_the_model_as_it_was(monkeypatch):
    from seqmoe.runtime.core import device as device_module

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model = fresh("gpt_oss")
    for p in model.model.layers[0].mlp.experts.parameters():
        p.requires_grad_(False)  # a mix of settings, kept as they were
    before = _state(model)
    monkeypatch.setattr(device_module, "_empty", oom)
    with pytest.raises(UserError, match=r"offload needs .* GiB on cpu .*slots x .* MiB for the expert pool"):
        offload(model, 0.5, "on-demand-lru")
    monkeypatch.undo()
    _assert_same(before, _state(model))
    _still_works(model, "gpt_oss")


@pytest.mark.parametrize("control", ["inline", "thread"])
def test_a_start_copy_that_raises_leaves_the_model_as_it_was(monkeypatch, control):
    model = fresh("mixtral")
    before, threads = _state(model), _seqmoe_threads()
    calls = [0]
    fill = ExpertPool.fill

    def failing_fill(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected copy failure")
        return fill(self, *args, **kwargs)

    monkeypatch.setattr(ExpertPool, "fill", failing_fill)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        offload(model, 0.5, "on-demand-lru", train=reference("mixtral").train, control=control)
    monkeypatch.undo()
    _assert_same(before, _state(model))
    assert _seqmoe_threads() == threads
    _still_works(model, "mixtral")


def test_a_failure_after_the_threads_started_stops_them_and_restores_the_model(monkeypatch):
    import importlib

    offload_module = importlib.import_module("seqmoe.runtime.offload")  # the package exports the function by that name

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the hooks go in

    model = fresh("deepseek_v3")
    before, threads = _state(model), _seqmoe_threads()
    monkeypatch.setattr(offload_module, "install_hooks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        offload(model, 0.5, "on-demand-lru", control="thread")
    monkeypatch.undo()
    _assert_same(before, _state(model))
    assert _seqmoe_threads() == threads
    _still_works(model, "deepseek_v3")


@pytest.mark.parametrize("device, match", [("meta", "not supported by the runtime"),
                                           ("tpu", "cannot use device|not supported"),
                                           ("cuda:7" if torch.cuda.is_available() else "cuda", "CUDA|does not exist")])
def test_a_bad_device_is_a_user_error_and_changes_nothing(device, match):
    model = fresh("olmoe")
    before = _state(model)
    with pytest.raises(UserError, match=match):
        offload(model, 0.5, device=device)
    _assert_same(before, _state(model))


@pytest.mark.parametrize("residency", ["0.5", "", True, [0.5]])  # None: the default (OffloadConfig.residency)
def test_a_residency_that_is_not_a_number_is_a_user_error(residency):
    with pytest.raises(UserError, match=r"residency must be a number in \(0, 1\]"):
        offload(fresh("olmoe"), residency)


def test_the_memory_check_says_what_is_needed_and_what_fits():
    mib, gib = 1 << 20, 1 << 30
    assert memory_shortfall("cuda:0", 64, 100 * mib, gib, 8 * gib, 256) is None
    why = memory_shortfall("cuda:0", 64, 100 * mib, 2 * gib, 6 * gib, 256)
    assert "needs 8.25 GiB on cuda:0 (64 slots x 100.0 MiB for the expert pool + 2.00 GiB for the rest" in why
    assert "6.00 GiB is free" in why
    assert "residency to at most 0.1562 (40 slots)" in why  # (6 - 2) GiB / 100 MiB = 40.96: 40 of 256 slots
    assert "the rest of the model alone does not fit" in memory_shortfall("cuda:0", 8, mib, 3 * gib, 2 * gib, 64)

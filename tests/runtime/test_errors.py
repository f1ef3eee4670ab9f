"""Bad input ends in a one-line UserError, and `import seqmoe` stays free of torch.

Run: pytest tests/runtime/test_errors.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.runtime import offload
from tests.runtime.conftest import fresh, greedy, reference


def test_import_seqmoe_does_not_import_torch():
    code = "import sys, seqmoe; assert 'torch' not in sys.modules; print(callable(seqmoe.offload))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("kwargs, match", [
    (dict(residency=0.05), r"fewer than the top-2"),
    (dict(residency=0.0), r"residency must be in \(0, 1\]"),
    (dict(residency=1.5), r"residency must be in \(0, 1\]"),
    (dict(system="belady"), r"cannot run live"),
    (dict(system="oracle-prefetch"), r"cannot run live"),
    (dict(system="seqmoe-hybrid"), r"seq2seq forecaster"),
    (dict(system="affinity-style"), r"pass train="),
    (dict(system="nope"), r"unknown system"),
    (dict(hardware="no-such-hw"), r"hardware"),
])
def test_bad_arguments_are_user_errors_and_leave_the_model_intact(kwargs, match):
    model = fresh("mixtral")
    before = sum(p.numel() for p in model.parameters())
    with pytest.raises(UserError, match=match):
        offload(model, **{"residency": 0.5, **kwargs})
    assert sum(p.numel() for p in model.parameters()) == before


def test_train_trace_of_another_shape_is_rejected():
    with pytest.raises(UserError, match="collect it from this model"):
        offload(fresh("mixtral"), 0.5, "affinity-style", train=reference("qwen2_moe").train)


def test_offloading_twice_is_rejected():
    model = fresh("olmoe")
    rt = offload(model, 0.5, control="thread")
    with pytest.raises(UserError, match="already offloaded"):
        offload(model, 0.5)
    greedy(model)  # still usable after a rejected call
    rt.restore()


def test_trace_before_running_is_a_user_error():
    rt = offload(fresh("olmoe"), 0.5)
    with pytest.raises(UserError, match="has not run"):
        rt.trace()
    rt.restore()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_generates_like_the_full_model_on_cuda():
    import copy

    ref_model = copy.deepcopy(reference("mixtral").model).to("cuda")
    ids = torch.tensor([[1, 17, 42, 5, 88, 23]], device="cuda")
    want = ref_model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model = fresh("mixtral")  # on the CPU: offload moves the dense remainder to the GPU
    rt = offload(model, 0.3, "on-demand-lru", device="cuda")
    assert next(model.parameters()).device.type == "cuda"
    assert rt.pool.hosts[0].is_pinned()
    got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    rt.synchronize()
    assert rt.pool.resident() and rt.stats()["device_expert_bytes"] <= rt.stats()["device_expert_bytes_limit"]
    rt.restore()

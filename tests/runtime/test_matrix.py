"""The runtime's options composed: storage x precision x control x batch x miss path, on three tiny
architectures, with the default system; each combination gives the greedy tokens of the same model at
full load (int4 and fp8-block: `quantize_experts`'s), so that a change that breaks one combination fails by name.
Run: pytest tests/runtime/test_matrix.py -q
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import seqmoe  # noqa: E402
from tests.arch.collect.tiny_models import save_tiny_checkpoint  # noqa: E402
from tests.runtime.conftest import TEST_HW  # noqa: E402

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")
HW = dataclasses.replace(TEST_HW, host_memory_bytes_per_s=5e9, host_cores=8)  # misses may go to the host CPU
PROMPTS = torch.tensor([[0, 0, 1, 17, 42, 5], [1, 61, 9, 33, 70, 12], [0, 3, 8, 44, 2, 90]])
MASK = (torch.arange(6) >= torch.tensor([[2], [0], [1]])).long()  # left padding
GEN = dict(max_new_tokens=6, do_sample=False, num_beams=1, pad_token_id=0)
PRECISIONS = (None, "int4", "fp8-block")  # the checkpoint's, seqmoe's groups, a shipped format's layout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{arch: (folder, {precision: the full model's greedy tokens for 1 and 3 prompts})}."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        save_tiny_checkpoint(arch, folder, tokenizer=False)
        full = AutoModelForCausalLM.from_pretrained(folder).eval()
        want = {}
        for precision in PRECISIONS:
            model = full if precision is None else seqmoe.quantize_experts(copy.deepcopy(full), precision)
            want[precision] = {1: _generate(model, 1), 3: _generate(model, 3)}
        out[arch] = (folder, full, want)
    return out


def _generate(model, batch: int) -> torch.Tensor:
    if batch == 1:
        return model.generate(PROMPTS[1:2], **GEN)
    return model.generate(PROMPTS, attention_mask=MASK, **GEN)


def _host_bytes(full, share: float) -> int:
    from seqmoe.arch import model_arch

    layers = model_arch(full).moe
    one = sum(p[0].numel() * p.element_size() for p in layers[0].experts.parameters())
    return int(share * len(layers) * layers[0].num_experts) * one


@pytest.mark.parametrize("miss", ["copy", "auto"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("control", ["inline", "thread"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("storage", ["host", "disk"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_combination_gives_the_full_models_tokens(checkpoints, arch, storage, precision, control, batch, miss):
    from transformers import AutoModelForCausalLM

    folder, full, want = checkpoints[arch]
    options = dict(residency=0.3, expert_dtype=precision, control=control, miss=miss, hardware=HW, learn=False)
    if storage == "disk":
        model, rt = seqmoe.load(folder, host_memory=_host_bytes(full, 0.3), **options)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        rt = seqmoe.offload(model, **options)
    try:
        got = _generate(model, batch)
        assert rt.stats()["control"] == control
    finally:
        rt.close()
    assert torch.equal(got, want[precision][batch])

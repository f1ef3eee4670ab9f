"""The real-size checkpoint writer (`seqmoe.runtime.timing.checkpoint`), at a small shape."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import seqmoe  # noqa: E402
from seqmoe.runtime.timing.checkpoint import write_checkpoint  # noqa: E402
from seqmoe.base.errors import UserError  # noqa: E402

SHAPE = dict(width_divisor=32, num_layers=3, vocab_size=200)


def test_a_written_checkpoint_loads_whole_and_streamed_to_the_same_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_checkpoint("deepseek-v2-lite", tmp_path / "ck", dtype=torch.float32, progress=False, **SHAPE)
    full = AutoModelForCausalLM.from_pretrained(folder).eval()  # transformers reads the per-expert names
    prompt = torch.tensor([[1, 5, 9, 14]])
    want = full.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model, rt = seqmoe.load(folder, residency=0.2, host_memory=12 * rt_row_bytes(full))
    try:
        assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), want)
    finally:
        rt.close()


def rt_row_bytes(full) -> int:
    from seqmoe.arch import model_arch

    experts = model_arch(full).moe[0].experts
    return sum(p[0].numel() * p.element_size() for p in experts.parameters())


def test_an_existing_folder_is_refused_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "there").mkdir()
    with pytest.raises(UserError, match="exists"):
        write_checkpoint("deepseek-v2-lite", tmp_path / "there", progress=False, **SHAPE)
    from seqmoe.runtime.timing import checkpoint

    calls = []

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real(tensors, path, metadata=metadata)

    real = checkpoint.save_file
    monkeypatch.setattr(checkpoint, "save_file", failing)
    with pytest.raises(OSError):
        write_checkpoint("deepseek-v2-lite", tmp_path / "new", progress=False, **SHAPE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]

"""`seqmoe convert`: a checkpoint written once with int4/int8/fp8 experts, loaded and streamed by seqmoe.
Run: pytest tests/runtime/disk/test_convert.py -q
"""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")

import seqmoe  # noqa: E402
from seqmoe.base.errors import UserError  # noqa: E402
from seqmoe.cli import main  # noqa: E402
convert = seqmoe.convert
from seqmoe.runtime.disk.index import CheckpointIndex  # noqa: E402

PROMPT = torch.tensor([[1, 61, 9, 33, 70, 12]])
GEN = dict(max_new_tokens=8, do_sample=False, num_beams=1, pad_token_id=0)


def _routed_bytes(folder, *suffixes) -> int:
    index = CheckpointIndex.open(folder)
    return sum(e.nbytes for k, e in index.tensors.items() if ".experts." in k or k.endswith(suffixes))


def _rows(folder) -> int:
    return sum(e.shape[0] for k, e in CheckpointIndex.open(folder).tensors.items() if k.endswith("seqmoe_rows"))


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_a_converted_checkpoint_streams_quantize_experts_tokens_in_a_third_of_the_bytes(saved, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    src, dst = saved(arch), tmp_path / "int4"
    assert main(["convert", str(src), str(dst), "--expert-dtype", "int4", "--no-progress"]) == 0
    full = AutoModelForCausalLM.from_pretrained(src).eval()
    ref = seqmoe.quantize_experts(copy.deepcopy(full), "int4")
    want = ref.generate(PROMPT, **GEN)
    # bf16 is what a checkpoint ships at: the int4 rows against the same weights' bf16 bytes
    bf16 = sum(p.numel() * 2 for layer in seqmoe.arch.model_arch(full).moe for p in layer.experts.parameters())
    stored = _routed_bytes(dst, "seqmoe_rows")
    assert stored <= 0.3 * bf16, (stored, bf16)
    model, rt = seqmoe.load(dst, residency=0.3, host_memory=stored // 2, learn=False)
    try:
        got = model.generate(PROMPT, **GEN)
        stats = rt.stats()
        assert stats["expert_dtype"] == "int4"
        assert stats["disk_reads"] > 0 and stats["disk_bytes"] == stats["disk_reads"] * stored // _rows(dst)
    finally:
        rt.close()
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch, precision", [("mixtral", "mxfp4"), ("gpt_oss", "q8_0")])
def test_a_checkpoint_converted_to_a_shipped_formats_layout_gives_its_quantize_experts_tokens(saved, tmp_path, arch,
                                                                                             precision):
    from transformers import AutoModelForCausalLM

    src, dst = saved(arch), tmp_path / precision
    assert main(["convert", str(src), str(dst), "--expert-dtype", precision, "--no-progress"]) == 0
    want = seqmoe.quantize_experts(AutoModelForCausalLM.from_pretrained(src).eval(), precision).generate(PROMPT, **GEN)
    model, rt = seqmoe.load(dst, residency=0.3, learn=False)
    try:
        assert rt.stats()["expert_dtype"] == precision
        assert rt.stats()["expert_bytes"] == _routed_bytes(dst, "seqmoe_rows") // _rows(dst)
        assert torch.equal(model.generate(PROMPT, **GEN), want)
    finally:
        rt.close()


def test_convert_refuses_to_overwrite_and_a_failed_convert_leaves_nothing(saved, tmp_path, monkeypatch):
    src = saved("qwen3_moe")
    (tmp_path / "taken").mkdir()
    with pytest.raises(UserError, match="exists"):
        convert(src, tmp_path / "taken", "int4")
    with pytest.raises(UserError, match="unknown expert precision"):
        convert(src, tmp_path / "x", "int3")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(seqmoe.arch.quant.QuantLayout, "pack_views", boom)
    with pytest.raises(OSError, match="disk full"):
        convert(src, tmp_path / "dst", "int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # neither dst nor its hidden partial


def test_a_converted_folder_says_what_opens_it(saved, tmp_path):
    src, dst = saved("qwen3_moe"), tmp_path / "fp8"
    report = convert(src, dst, "fp8")
    assert report.expert_bytes_after < report.expert_bytes_before
    with pytest.raises(UserError, match="seqmoe.load"):
        seqmoe.arch.collect.load_model(dst, tokenizer=False)
    with pytest.raises(UserError, match="holds fp8 experts"):
        seqmoe.load(dst, residency=0.5, expert_dtype="int4")
    with pytest.raises(UserError, match="convert the original"):
        convert(dst, tmp_path / "again", "int4")
    marker = dst / "seqmoe_experts.json"
    marker.write_text(json.dumps({"format": 99, "precision": "fp8"}))
    with pytest.raises(UserError, match="format 99"):
        seqmoe.load(dst, residency=0.5)
    marker.write_text("{")
    with pytest.raises(UserError, match="malformed"):
        seqmoe.load(dst, residency=0.5)


def test_generate_opens_a_converted_folder_with_its_experts_in_the_host_cache(tmp_path, capsys):
    from tests.arch.collect.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("qwen3_moe", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "int8", "int8")
    assert main(["generate", "--model", str(tmp_path / "int8"), "--prompt", "the cat", "--residency", "0.5",
                 "--max-new-tokens", "3", "--device", "cpu", "--json", "--no-progress"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["expert_dtype"] == "int8" and stats["disk_reads"] > 0

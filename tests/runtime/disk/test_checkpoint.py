"""ExpertFiles: rows from sharded and bf16 checkpoints, merged reads, concurrent readers, and clear
errors (never wrong rows) for files missing, truncated or changed since open, or unknown parts."""

import json
import os
import shutil
import threading
from dataclasses import replace

import pytest
import torch

from seqmoe.arch import model_arch
from seqmoe.runtime.disk.checkpoint import ExpertFiles
from seqmoe.runtime.disk.index import CheckpointChanged
from seqmoe.runtime.disk.skeleton import load_skeleton
from seqmoe.base.errors import UserError
from tests.arch.collect.tiny_models import tiny_model
from tests.runtime.disk.test_skeleton import _packed


def _files(folder, model=None, mode=None, layout=None):
    """ExpertFiles of `folder` mapped with the layout of `model` (default: its skeleton)."""
    if model is None:
        model, _ = load_skeleton(folder)
    arch = model_arch(model)
    names = {id(m): n for n, m in model.named_modules()}
    paths = [names[id(m.experts)] for m in arch.moe]
    return ExpertFiles.open(folder, paths, layout or arch.layout(arch.moe[0].experts), arch.num_experts, mode=mode)


def _copy(saved, arch, tmp_path):
    dst = tmp_path / arch
    shutil.copytree(saved(arch), dst)
    return dst


def _read_all(files, dtype=torch.float32):
    out = []
    for layer in range(files.num_layers):
        rows = torch.empty(8, files.layout.numel, dtype=dtype)
        for e in range(8):
            files.read_into(layer, e, rows[e])
        out.append(rows)
    return out


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_sharded_checkpoint(tmp_path, mode):
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 2
    with _files(tmp_path, mode=mode) as files:
        assert len({r.file for plans in files._plans for p in plans for r in p}) > 1
        got = _read_all(files)
    for a, b in zip(got, _packed(model)):
        assert torch.equal(a, b)


def test_bf16_on_disk_fp32_model(tmp_path):
    """The checkpoint's dtype differs from the model's: converted after reading, as from_pretrained does."""
    model = tiny_model("deepseek_v3")
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    fp32, _ = load_skeleton(tmp_path, dtype=torch.float32)
    with _files(tmp_path, fp32) as files:
        assert files.layout.dtype == torch.float32
        got = _read_all(files)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for a, b in zip(got, _packed(ref)):
        assert torch.equal(a, b)


def test_adjacent_ranges_merge(saved):
    with _files(saved("mixtral")) as files:
        # w1, w2, w3 of one expert lie next to each other: one read, scattered into row order
        assert all(len(files._plans[layer][e]) == 1 for layer in range(files.num_layers) for e in range(8))
        assert files.expert_nbytes(0, 3) == files.layout.expert_bytes
        assert "model.layers.2.block_sparse_moe.experts.7.w2.weight" in files.expert_keys
        assert not any("gate.weight" in k for k in files.expert_keys)


def test_concurrent_readers(saved):
    want = _packed(tiny_model("olmoe"))
    with _files(saved("olmoe")) as files:
        P, bad = files.layout.numel, []

        def work(t):
            out = torch.empty(P)
            for i in range(60):
                layer, e = (i + t) % files.num_layers, (i * 3 + t) % 8
                files.read_into(layer, e, out)
                if not torch.equal(out, want[layer][e]):
                    bad.append((layer, e))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not bad
        assert files.bytes_read == 240 * files.expert_nbytes(0, 0)


def _expect_changed(files, match):
    out = torch.zeros(files.layout.numel)
    with pytest.raises(CheckpointChanged, match=match) as err:
        files.read_into(1, 3, out)
    assert "layer 1 expert 3" in str(err.value) and "model.safetensors" in str(err.value)
    assert "reload the model" in str(err.value)
    return out


def test_missing_file_after_open(saved, tmp_path):
    folder = _copy(saved, "qwen3_moe", tmp_path)
    with _files(folder) as files:
        os.unlink(folder / "model.safetensors")
        _expect_changed(files, "missing")
        with pytest.raises(CheckpointChanged):
            files.check()


def test_truncated_file(saved, tmp_path):
    folder = _copy(saved, "qwen3_moe", tmp_path)
    with _files(folder) as files:
        os.truncate(folder / "model.safetensors", os.path.getsize(folder / "model.safetensors") // 2)
        _expect_changed(files, "truncated")


@pytest.mark.parametrize("how", ["replaced", "in_place"])
def test_file_changed_same_size(saved, tmp_path, how):
    folder = _copy(saved, "qwen3_moe", tmp_path)
    path = folder / "model.safetensors"
    with _files(folder) as files:
        st = os.stat(path)
        data = bytearray(path.read_bytes())
        data[-64:] = bytes(64)  # the same size, other numbers
        if how == "replaced":  # a new file renamed over the old: a new inode
            (folder / "new").write_bytes(data)
            os.replace(folder / "new", path)
        else:  # rewritten in place, later (a clock tick may be coarser than this test)
            with open(path, "r+b") as f:
                f.write(data)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert os.path.getsize(path) == st.st_size
        out = _expect_changed(files, "changed")
        assert not out.any()  # nothing was written into the row


def test_unknown_layout_part(saved):
    model, skel = load_skeleton(saved("olmoe"))
    layout = replace(skel.layout, names=("gate_up_proj", "router_proj"))
    with pytest.raises(UserError, match="router_proj of layer 0 expert 0") as err:
        _files(saved("olmoe"), model, layout=layout)
    assert "model.layers.0.mlp.experts.0.router_proj.weight" in str(err.value)  # the keys tried


def test_wrong_shape_is_refused(saved):
    model, skel = load_skeleton(saved("olmoe"))
    layout = replace(skel.layout, shapes=((64, 32), skel.layout.shapes[1]))
    with pytest.raises(UserError, match="has shape .* needs"):
        _files(saved("olmoe"), model, layout=layout)


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "fp8"}, "fp8$"),  # no block size: per-tensor FP8
    ({"quant_method": "fp8", "weight_block_size": [128, 64]}, r"fp8 \(weight_block_size=\[128, 64\]\)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes$"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"gptq \(bits=8, group_size=128\)")])
def test_a_quantization_seqmoe_does_not_read_is_refused_in_one_line_naming_what_it_reads(saved, tmp_path, qc, named):
    folder = _copy(saved, "mixtral", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    want = f"quantized by {named[:-1] if named.endswith('$') else named};.* seqmoe reads fp8 with square blocks .*mxfp4.*gptq"
    for load in (lambda: load_skeleton(folder), lambda: _files(folder, tiny_model("mixtral"))):
        with pytest.raises(UserError, match=want) as err:
            load()
        assert "\n" not in str(err.value)


def test_missing_shard_at_open(tmp_path):
    tiny_model("olmoe").save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(UserError, match=f"{shard.name} is missing"):
        load_skeleton(tmp_path)


def test_lacking_dense_key_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(saved, "qwen3_moe", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.self_attn.q_norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="lacks model.layers.2.self_attn.q_norm.weight"):
        load_skeleton(folder)


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16, torch.float32])
def test_convert_into_matches_torch(src, dst):
    from seqmoe.runtime.disk.checkpoint import convert_into

    x = (torch.randn(1001) * 100).to(src)
    x[:3] = torch.tensor([float("inf"), -0.0, 1e-30])
    buf = bytearray(x.view(torch.uint8).numpy().tobytes())
    out = torch.zeros(1004, dtype=dst)
    convert_into(memoryview(buf), src, out[3:])
    assert torch.equal(out[3:], x.to(dst)) and not out[:3].any()


def test_file_rewritten_in_place_with_its_old_mtime_is_caught_by_its_bytes(saved, tmp_path):
    folder = _copy(saved, "qwen3_moe", tmp_path)
    path = folder / "model.safetensors"
    with _files(folder) as files:
        first = torch.zeros(files.layout.numel)
        files.read_into(1, 3, first)  # its fingerprint
        st = os.stat(path)
        data = bytearray(path.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")  # the tensors, after the header
        data[start:] = bytes(x ^ 0x5A for x in data[start:])  # other numbers, the same size
        with open(path, "r+b") as f:
            f.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # size, inode and mtime as at open
        files.index.check()  # what the file's metadata tells: nothing changed
        with pytest.raises(CheckpointChanged, match="rewritten in place"):
            files.read_into(1, 3, torch.zeros(files.layout.numel))

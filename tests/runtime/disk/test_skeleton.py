"""load_skeleton builds every non-expert tensor exactly as from_pretrained does, reads no expert byte,
and ExpertFiles then gives the packed rows layout.pack gives for the fully loaded model."""

import pytest
import torch

from seqmoe.arch import model_arch
from seqmoe.runtime.disk.index import CheckpointIndex
from seqmoe.runtime.disk.skeleton import load_skeleton
from tests.arch.collect.tiny_models import ARCHS


def _reference(folder, dtype=None):
    from transformers import AutoModelForCausalLM

    kw = {} if dtype is None else {"dtype": dtype}
    return AutoModelForCausalLM.from_pretrained(folder, **kw).eval()


def _packed(model) -> list[torch.Tensor]:
    """[E, P] rows of each MoE layer of a fully loaded model."""
    arch = model_arch(model)
    out = []
    for m in arch.moe:
        layout = arch.layout(m.experts)
        host = torch.empty(arch.num_experts, layout.numel, dtype=layout.dtype)
        layout.pack(m.experts, host)
        out.append(host)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_skeleton_equals_from_pretrained(saved, arch):
    model, skel = load_skeleton(saved(arch))
    ref = _reference(saved(arch))
    expert_names = {f"{p}.{n}" for p in skel.experts_paths for n in skel.layout.names}
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    assert set(params) == set(ref_params)
    assert expert_names and expert_names <= set(params)
    for name, p in params.items():
        if name in expert_names:
            assert p.is_meta, name
        else:
            assert not p.is_meta and p.dtype == ref_params[name].dtype, name
            assert torch.equal(p, ref_params[name]), name
    buffers, ref_buffers = dict(model.named_buffers()), dict(ref.named_buffers())
    assert set(buffers) == set(ref_buffers)
    for name, b in buffers.items():
        assert torch.equal(b, ref_buffers[name]), name
    assert not model.training


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_rows_equal_pack(saved, arch):
    _, skel = load_skeleton(saved(arch))
    want = _packed(_reference(saved(arch)))
    with skel.open_files() as files:
        assert files.num_layers == len(want)
        out = torch.empty(skel.layout.numel, dtype=skel.layout.dtype)
        for layer, rows in enumerate(want):
            for e in range(skel.num_experts):
                out.fill_(float("nan"))
                files.read_into(layer, e, out)
                assert torch.equal(out, rows[e]), (layer, e)
        total = sum(files.expert_nbytes(layer, e) for layer in range(len(want)) for e in range(skel.num_experts))
        assert files.bytes_read == total


def test_skeleton_reads_no_expert(saved, monkeypatch):
    folder = saved("mixtral")
    read_keys = []
    original = CheckpointIndex.read_tensor

    def counting(self, key, *a, **kw):
        read_keys.append(key)
        return original(self, key, *a, **kw)

    monkeypatch.setattr(CheckpointIndex, "read_tensor", counting)
    _, skel = load_skeleton(folder)
    with skel.open_files() as files:
        assert files.expert_keys and not files.expert_keys & set(read_keys)
        assert files.bytes_read == 0
        index = skel.index
        assert skel.dense_bytes == sum(index.tensors[k].nbytes for k in read_keys)
        # every checkpoint byte is either dense (read once here) or an expert's (left to ExpertFiles)
        experts = sum(files.expert_nbytes(layer, e) for layer in range(files.num_layers) for e in range(skel.num_experts))
        assert skel.dense_bytes + experts == sum(t.nbytes for t in index.tensors.values())
    assert len(read_keys) == len(set(read_keys))


def test_bf16_skeleton_matches(saved, tmp_path):
    """A bf16 model from an fp32 checkpoint: the same conversion as from_pretrained(dtype=bfloat16)."""
    model, skel = load_skeleton(saved("qwen3_moe"), dtype=torch.bfloat16)
    ref = _reference(saved("qwen3_moe"), torch.bfloat16)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        if not p.is_meta:
            assert torch.equal(p, ref_params[name]), name
    assert skel.layout.dtype == torch.bfloat16
    with skel.open_files() as files:
        out = torch.empty(skel.layout.numel, dtype=torch.bfloat16)
        files.read_into(1, 5, out)
        assert torch.equal(out, _packed(ref)[1][5])


def test_tied_embeddings(tmp_path):
    from tests.arch.collect.tiny_models import tiny_model

    model = tiny_model("qwen3_moe")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path)
    skel_model, skel = load_skeleton(tmp_path)
    assert "lm_head.weight" not in skel.index.tensors  # so only tie_weights can have set it
    assert skel_model.lm_head.weight is skel_model.model.embed_tokens.weight
    assert torch.equal(skel_model.lm_head.weight, _reference(tmp_path).lm_head.weight)


def test_layout_strip_works_on_meta_experts(saved):
    model, skel = load_skeleton(saved("deepseek_v3"))
    experts = model_arch(model).moe[0].experts
    kept = skel.layout.strip(experts)
    assert set(kept) == set(skel.layout.names)
    assert all(name not in dict(experts.named_parameters(recurse=False)) for name in kept)

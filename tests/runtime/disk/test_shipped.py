"""Checkpoints as they ship (issue 41): tiny checkpoints written in FP8 with 128 x 128 blocks (DeepSeek-V3 /
Qwen3-FP8 keys), MXFP4 (gpt-oss's keys, and per-expert FP4 codes in an FP8 release) and GPTQ int4
(AutoGPTQ's keys), loaded by seqmoe with their
experts kept in the file's codes, offloaded (every expert in the host cache) and streamed (a host cache
of 30 % of them), give the tokens and logits of the reference: transformers' own dequantizing load of
the same file (FP8, MXFP4), or for GPTQ, which transformers cannot read on a CPU without gptqmodel, the
file decoded by AutoGPTQ's formula (`seqmoe.arch.shipped`, checked bit by bit in tests/arch/test_shipped.py)
and saved unquantized. The host rows hold the file's bytes; `seqmoe convert` rounds them again only when told.
Run: pytest tests/runtime/disk/test_shipped.py -q
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers' FP8 loader needs it

import seqmoe  # noqa: E402
from seqmoe.arch.quant import quantize_experts  # noqa: E402
from seqmoe.arch.shipped import SHIPPED_CODECS  # noqa: E402
from seqmoe.base.errors import UserError  # noqa: E402
from seqmoe.runtime.disk.checkpoint import ExpertFiles  # noqa: E402
from seqmoe.runtime.disk.index import CheckpointIndex  # noqa: E402
from seqmoe.runtime.disk.skeleton import meta_model  # noqa: E402
from tests.arch.collect.tiny_models import _COMMON  # noqa: E402

PROMPT = torch.tensor([[1, 61, 9, 33, 70, 12]])
GEN = dict(max_new_tokens=8, do_sample=False, num_beams=1, pad_token_id=0)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                     "model.embed_tokens", "lm_head"]}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
               "checkpoint_format": "gptq"}
LINEAR = re.compile(r"(experts\.\d+\.(w1|w2|w3|\w+_proj)|self_attn\.\w+_proj)\.weight$")
"""The linears a shipped release quantizes: the experts' and attention's (router, norms, embeddings stay)."""


def _rewrite(src, dst, quantization_config, tensors):
    """dst: src's folder with its safetensors replaced by `tensors(state dict)` and the quantization_config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    save_file(tensors(load_file(src / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return dst


def _fp8(sd):
    out = {}
    for k, v in sd.items():
        if LINEAR.search(k):
            parts = SHIPPED_CODECS["fp8-block"].encode(v[None])
            out[k], out[k + "_scale_inv"] = parts["weight"][0], parts["weight_scale_inv"][0]
        else:
            out[k] = v
    return out


def _mxfp4(sd):  # gpt-oss: fused [E, in, out] parameters stored as [E, out, in / 32, 16] blocks and their scales
    out = {}
    for k, v in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = SHIPPED_CODECS["mxfp4"].encode(v.transpose(1, 2))
            out[k + "_blocks"], out[k + "_scales"] = parts["blocks"], parts["scales"]
        else:
            out[k] = v
    return out


def _fp8_fp4_experts(sd):
    """FP8 attention, the experts packed as FP4 under the same fp8 config (codes as `weight` int8 [rows,
    cols / 2], E8M0 exponents as `weight_scale_inv`), as transformers' FP8 loader reads them."""
    out = _fp8({k: v for k, v in sd.items() if ".experts." not in k})
    for k, v in sd.items():
        if ".experts." in k:
            parts = SHIPPED_CODECS["mxfp4"].encode(v[None])
            out[k] = parts["blocks"][0].reshape(v.shape[0], -1).view(torch.int8)
            out[k + "_scale_inv"] = parts["scales"][0]
    return out


def _gptq(sd):
    out = {}
    for k, v in sd.items():
        if LINEAR.search(k) and v.shape[1] % 128 == 0:
            for s, t in SHIPPED_CODECS["gptq-int4"].encode(v[None]).items():
                out[k.removesuffix("weight") + s] = t[0]
        else:
            out[k] = v
    return out


def _gptq_decoded(folder, dst):
    """The reference of a GPTQ folder: each linear decoded by the format's formula, saved unquantized."""
    def decode(sd):
        out = {k: v for k, v in sd.items() if not k.endswith(("qweight", "qzeros", "scales", "g_idx"))}
        for k in [k for k in sd if k.endswith(".qweight")]:
            base = k.removesuffix("qweight")
            parts = {s: sd[base + s][None] for s in ("qweight", "qzeros", "scales", "g_idx")}
            rows, cols = sd[base + "qweight"].shape[1], sd[base + "qweight"].shape[0] * 8
            out[base + "weight"] = SHIPPED_CODECS["gptq-int4"].decode(parts, rows, cols)[0]
        return out
    dst = _rewrite(folder, dst, None, decode)
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A qwen3_moe and a mixtral whose matrices have 128 inputs (GPTQ's group), saved once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folders = {}
    for arch, extra in (("qwen3_moe", dict(num_experts=8, moe_intermediate_size=128, head_dim=32)),
                        ("mixtral", dict(num_local_experts=8, intermediate_size=128, head_dim=32))):
        config = AutoConfig.for_model(arch, **{**_COMMON, "hidden_size": 128, "num_hidden_layers": 2, **extra})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0, 1)  # decided routing: near-ties flip under rounding noise
        folders[arch] = tmp_path_factory.mktemp(f"wide-{arch}")
        model.save_pretrained(folders[arch])
    return folders


def _same_as_reference(folder, reference):
    """seqmoe.load of `folder`, offloaded and streamed, against `reference` (a loaded transformers model)."""
    want = reference.generate(PROMPT, **GEN)
    with torch.no_grad():
        ref_logits = reference(want).logits
    host = None
    for streamed in (False, True):
        model, runtime = seqmoe.load(folder, residency=0.3, device="cpu", dtype="float32",
                                     **({"host_memory": int(0.3 * host)} if streamed else {}))
        try:
            s = runtime.stats()
            host = s["expert_bytes"] * s["num_layers"] * s["num_experts"]
            assert torch.equal(model.generate(PROMPT, **GEN), want), ("streamed" if streamed else "offloaded")
            with torch.no_grad():
                torch.testing.assert_close(model(want).logits, ref_logits, rtol=0, atol=1e-5)
        finally:
            runtime.close()
    return s


def _file_expert_bytes(folder, layers, experts) -> float:
    index = CheckpointIndex.open(folder)
    return sum(e.nbytes for k, e in index.tensors.items() if ".experts" in k) / (layers * experts)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_an_fp8_block_checkpoint_gives_transformers_tokens_and_keeps_its_bytes(saved, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    folder = _rewrite(saved(arch), tmp_path / "fp8", FP8_CONFIG, _fp8)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # dequantized on a CPU
    s = _same_as_reference(folder, reference)
    assert s["expert_dtype"] == "fp8-block"
    assert s["expert_bytes"] == _file_expert_bytes(folder, s["num_layers"], s["num_experts"])


def test_an_mxfp4_gpt_oss_checkpoint_gives_transformers_tokens_and_keeps_its_bytes(saved, tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder = _rewrite(saved("gpt_oss"), tmp_path / "mxfp4", MXFP4_CONFIG, _mxfp4)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     quantization_config=Mxfp4Config(dequantize=True)).eval()
    s = _same_as_reference(folder, reference)
    assert s["expert_dtype"] == "mxfp4"
    # codes, scales and the biases (kept at the model's dtype, float32 as in this file)
    assert s["expert_bytes"] == _file_expert_bytes(folder, s["num_layers"], s["num_experts"])


def test_an_fp8_checkpoint_of_another_block_side_reads_its_blocks(wide, tmp_path):
    """weight_block_size [64, 64]: the layout is fp8-block-64, the scales one per 64 x 64 block."""
    from transformers import AutoModelForCausalLM

    codec = SHIPPED_CODECS["fp8-block-64"]

    def fp8_64(sd):
        out = {}
        for k, v in sd.items():
            if LINEAR.search(k):
                parts = codec.encode(v[None])
                out[k], out[k + "_scale_inv"] = parts["weight"][0], parts["weight_scale_inv"][0]
            else:
                out[k] = v
        return out

    folder = _rewrite(wide["qwen3_moe"], tmp_path / "fp8-64", {**FP8_CONFIG, "weight_block_size": [64, 64]}, fp8_64)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    s = _same_as_reference(folder, reference)
    assert s["expert_dtype"] == "fp8-block-64"
    assert s["expert_bytes"] == _file_expert_bytes(folder, s["num_layers"], s["num_experts"])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp4_experts_of_an_fp8_checkpoint_give_transformers_tokens(wide, tmp_path, arch):
    """The second MXFP4 layout: per-expert FP4 codes and E8M0 scales in an FP8 release (not gpt-oss's keys)."""
    from transformers import AutoModelForCausalLM

    folder = _rewrite(wide[arch], tmp_path / "fp4", FP8_CONFIG, _fp8_fp4_experts)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    s = _same_as_reference(folder, reference)
    assert s["expert_dtype"] == "mxfp4"
    assert s["expert_bytes"] == _file_expert_bytes(folder, s["num_layers"], s["num_experts"])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_gptq_checkpoint_gives_its_formulas_tokens_and_keeps_its_bytes(wide, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    folder = _rewrite(wide[arch], tmp_path / "gptq", GPTQ_CONFIG, _gptq)
    reference = AutoModelForCausalLM.from_pretrained(_gptq_decoded(folder, tmp_path / "decoded"), dtype=torch.float32)
    s = _same_as_reference(folder, reference.eval())
    assert s["expert_dtype"] == "gptq-int4"
    assert s["expert_bytes"] == _file_expert_bytes(folder, s["num_layers"], s["num_experts"])


def test_convert_requantizes_a_shipped_checkpoint_only_when_told_and_nothing_misreads_its_codes(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = _rewrite(saved("qwen3_moe"), tmp_path / "fp8", FP8_CONFIG, _fp8)
    with pytest.raises(UserError, match="ships its experts as fp8-block: converting them to int4 rounds them a second time"):
        seqmoe.convert(folder, tmp_path / "int4", "int4")
    assert not (tmp_path / "int4").exists()
    model, paths, base = meta_model(folder)  # the model-dtype layout would read FP8 codes as numbers
    with pytest.raises(UserError, match="stores its experts as fp8-block, not as the model dtype"):
        ExpertFiles.open(folder, paths, base, 8)
    seqmoe.convert(folder, tmp_path / "int4", "int4", requantize=True)
    reference = quantize_experts(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), "int4")
    model, runtime = seqmoe.load(tmp_path / "int4", residency=0.3, device="cpu", dtype="float32")
    try:
        assert runtime.stats()["expert_dtype"] == "int4"
        assert torch.equal(model.generate(PROMPT, **GEN), reference.generate(PROMPT, **GEN))
    finally:
        runtime.close()

"""GGUF files (issue 41): a tiny Qwen3-MoE written with gguf-py as llama.cpp names and stores it (experts
as blk.N.ffn_{gate,up,down}_exps in Q4_K / Q8_0 blocks, the rest f32), loaded by `seqmoe.load` with its
experts kept in their blocks, offloaded and streamed, gives the tokens and logits of transformers' own
reading of the file (`from_pretrained(gguf_file=...)`, which dequantizes everything); files seqmoe cannot
keep in one expert layout are refused before loading, in one line.
Run: pytest tests/runtime/disk/test_gguf.py -q
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import seqmoe  # noqa: E402
from seqmoe.arch.gguf_writer import write_gguf  # noqa: E402
from seqmoe.base.errors import UserError  # noqa: E402
from tests.arch.collect.tiny_models import _COMMON  # noqa: E402

PROMPT = torch.tensor([[1, 61, 9, 33, 70, 12]])
GEN = dict(max_new_tokens=8, do_sample=False, num_beams=1, pad_token_id=0)
H, I, E, L = 256, 768, 8, 2  # Q4_K blocks are 256 inputs; transformers' GGUF reader takes Qwen3-MoE's 768 wide experts


@pytest.fixture(scope="module")
def model():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **{**_COMMON, "hidden_size": H, "num_hidden_layers": L, "num_experts": E,
                                                  "moe_intermediate_size": I, "head_dim": 64, "norm_topk_prob": True})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 1)  # decided routing: near-ties flip under rounding noise
    return model


def test_a_gguf_file_gives_transformers_tokens_with_its_experts_in_their_blocks(model, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_gguf(model, tmp_path / "tiny.gguf")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    want = reference.generate(PROMPT, **GEN)
    with torch.no_grad():
        ref_logits = reference(want).logits
    per_expert = 2 * I * (H // 256) * 144 + H * (I // 32) * 34  # gate and up in Q4_K, down in Q8_0
    for host in (None, int(0.3 * L * E * per_expert)):
        net, runtime = seqmoe.load(path, residency=0.3, device="cpu", dtype="float32",
                                   **({} if host is None else {"host_memory": host}))
        try:
            s = runtime.stats()
            assert (s["expert_dtype"], s["expert_bytes"]) == ("q4_k/q4_k/q8_0", per_expert)
            assert torch.equal(net.generate(PROMPT, **GEN), want)
            with torch.no_grad():
                torch.testing.assert_close(net(want).logits, ref_logits, rtol=0, atol=1e-5)
        finally:
            runtime.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(last_down="q4_k"), r"stores layer 1's experts as Q4_K/Q4_K/Q4_K and layer 0's as Q4_K/Q4_K/Q8_0; .* --pure"),
    (dict(formats=("q4_k", "q4_k", "f16")),
     r"stores its experts as Q4_K/Q4_K/F16; seqmoe reads GGUF experts in Q8_0, Q5_0, Q4_K"),
    (dict(arch="llama"), r"GGUF file of a llama model; seqmoe reads GGUF files of qwen2moe, qwen3moe models"),
])
def test_a_gguf_file_seqmoe_cannot_keep_is_refused_before_loading(model, tmp_path, kwargs, match):
    path = write_gguf(model, tmp_path / "tiny.gguf", **kwargs)
    with pytest.raises(UserError, match=match) as err:
        seqmoe.load(path, residency=0.3, device="cpu")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="GGUF file, which transformers would dequantize whole"):
        seqmoe.arch.collect.load_model(path, tokenizer=False)


def test_seqmoe_generate_opens_a_gguf_file_with_the_tokenizer_it_carries(model, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqmoe.cli import main

    path = write_gguf(model, tmp_path / "tiny.gguf", tokenizer=True)
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok("abc def", return_tensors="pt").input_ids
    want = tok.decode(reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.shape[1]:],
                      skip_special_tokens=True)
    assert main(["generate", "--model", str(path), "--prompt", "abc def", "--max-new-tokens", "6", "--device", "cpu",
                 "--dtype", "float32", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("abc def" + want + "\n")


@pytest.mark.parametrize("keep", [4, 200])  # the magic alone; a header cut short
def test_a_file_that_is_not_a_whole_gguf_is_refused_in_one_line(model, tmp_path, keep):
    path = write_gguf(model, tmp_path / "tiny.gguf")
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(UserError, match="is not a GGUF file gguf-py reads") as err:
        seqmoe.load(path, residency=0.3, device="cpu")
    assert "\n" not in str(err.value)


def test_a_random_file_written_one_tensor_at_a_time_reads_as_transformers_reads_it(model, tmp_path):
    """`write_random_gguf` (the llama.cpp benchmark's files bigger than memory): f16 matrices outside the
    experts, Q8_0 experts, seeded; seqmoe streaming it gives transformers' tokens of the same file."""
    from transformers import AutoModelForCausalLM

    from seqmoe.arch.gguf_writer import write_random_gguf

    path = write_random_gguf(model.config, tmp_path / "random.gguf", seed=3)
    again = write_random_gguf(model.config, tmp_path / "again.gguf", seed=3)
    assert path.read_bytes() == again.read_bytes()
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert {types[f"blk.1.ffn_{w}_exps.weight"] for w in ("gate", "up", "down")} == {"Q8_0"}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    want = reference.generate(PROMPT, **GEN)
    assert not torch.equal(want, model.generate(PROMPT, **GEN))  # its own weights, not the fixture's
    net, runtime = seqmoe.load(path, residency=0.3, device="cpu", dtype="float32", host_memory="4MiB")
    try:
        assert torch.equal(net.generate(PROMPT, **GEN), want)
    finally:
        runtime.close()

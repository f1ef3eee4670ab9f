"""The formats checkpoints ship in (`seqmoe.arch.shipped`): each codec's tensors have the shapes and
dtypes its files use and the bytes the simulator prices, and decode as the format's own readers do:
transformers' FP8-block and MXFP4 dequantizers, gguf-py's GGUF blocks, AutoGPTQ's formula for GPTQ.
Run: pytest tests/arch/test_shipped.py -q
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from seqmoe.arch.shipped import SHIPPED_CODECS, gptq_encode  # noqa: E402
from seqmoe.costs.precision import SHIPPED, matrix_bytes  # noqa: E402

ROWS, COLS = 64, 512


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn((3, ROWS, COLS), generator=g) * 0.05
    w[1, :7] *= 40  # rows of another scale: blocks must not share it
    w[2, 3, :128] = 0  # an all-zero block
    return w


@pytest.mark.parametrize("name", list(SHIPPED))
def test_tensors_are_the_files_and_priced_as_the_simulator_prices_them(name, weights):
    codec = SHIPPED_CODECS[name]
    parts = codec.encode(weights)
    assert {k: (tuple(v.shape[1:]), v.dtype) for k, v in parts.items()} == codec.tensors(ROWS, COLS)
    stored = sum(v[0].numel() * v.element_size() for v in parts.values())  # one matrix's tensors
    assert stored == matrix_bytes(ROWS, COLS, name)
    back = codec.decode(parts, ROWS, COLS)
    assert back.shape == weights.shape and back.dtype == torch.float32
    assert torch.all(back[2, 3, :128] == 0)
    # each row within its format's rounding of its own scale (MXFP4's floor exponent clips to 6 of 8,
    # Q5_0's code for the largest magnitude leaves the other sign 15 of 16 steps)
    tol = {"fp8-block": 0.07, "mxfp4": 0.26, "gptq-int4": 0.07, "q8_0": 0.01, "q5_0": 0.07, "q4_k": 0.07}[name]
    err = (back - weights).abs().amax(-1) / weights.abs().amax(-1).clamp_min(1e-12)
    assert err.max() <= tol


def test_fp8_block_decodes_as_transformers_does():
    """transformers derives the block from the scale grid, so it reads whole blocks: 256 x 384."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    w = torch.randn((2, 256, 384), generator=torch.Generator().manual_seed(2))
    parts = SHIPPED_CODECS["fp8-block"].encode(w)
    theirs = torch.stack([fp8.Fp8Dequantize(None)._dequantize_one(q, s, torch.float32)
                          for q, s in zip(parts["weight"], parts["weight_scale_inv"])])
    assert torch.equal(SHIPPED_CODECS["fp8-block"].decode(parts, 256, 384), theirs)


def test_fp8_edge_blocks_decode_as_deepseeks_weight_dequant():
    """A matrix whose sides are not multiples of 128 (DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168]) has
    partial edge blocks: the scale of element (i, j) is scale[i // 128, j // 128], as DeepSeek-V3's own
    `weight_dequant` reads it (a grid of ceil-divided blocks). transformers' CPU dequantizer derives the
    block from the grid instead (160 / 2 = 80) and reads such a matrix with the wrong scales."""
    w = torch.randn((1, 160, 300), generator=torch.Generator().manual_seed(3))
    parts = SHIPPED_CODECS["fp8-block"].encode(w)
    assert parts["weight_scale_inv"].shape == (1, 2, 3)
    codes, scale = parts["weight"][0].float(), parts["weight_scale_inv"][0]
    want = torch.empty((160, 300))
    for bi in range(2):  # block by block, as the reference kernel's programs do
        for bj in range(3):
            rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            want[rows, cols] = codes[rows, cols] * scale[bi, bj]
    got = SHIPPED_CODECS["fp8-block"].decode(parts, 160, 300)[0]
    assert torch.equal(got, want)
    assert (got - w[0]).abs().max() < 0.07 * w.abs().max()


def test_mxfp4_decodes_as_transformers_reads_gpt_oss(weights):
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    parts = SHIPPED_CODECS["mxfp4"].encode(weights)
    theirs = mx.convert_moe_packed_tensors(parts["blocks"], parts["scales"], dtype=torch.float32)  # [n, cols, rows]
    assert torch.equal(SHIPPED_CODECS["mxfp4"].decode(parts, ROWS, COLS), theirs.transpose(1, 2))


@pytest.mark.parametrize("name", ["q8_0", "q5_0", "q4_k"])
def test_gguf_blocks_decode_as_gguf_py(name, weights):
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    kind = getattr(GGMLQuantizationType, name.upper())
    parts = SHIPPED_CODECS[name].encode(weights)
    theirs = torch.from_numpy(gq.dequantize(parts[""].numpy(), kind))
    assert torch.equal(SHIPPED_CODECS[name].decode(parts, ROWS, COLS), theirs)
    if name != "q4_k":  # gguf-py quantizes these two (ggml's reference rounding): the same bytes
        assert torch.equal(parts[""], torch.from_numpy(gq.quantize(weights.numpy(), kind)))


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_decodes_by_autogptq_formula(sym, weights):
    """w[o, i] = scales[g_idx[i], o] x (q[i, o] - (zeros[g_idx[i], o] + 1)), codes and zeros read bit by
    bit from their int32 words; a shuffled g_idx (desc_act) is read through."""
    parts = gptq_encode(weights, sym=sym)
    perm = torch.randperm(COLS, generator=torch.Generator().manual_seed(1))
    parts["g_idx"] = parts["g_idx"][:, perm].contiguous()  # another grouping the decoder must follow
    n = weights.shape[0]
    want = torch.empty((n, ROWS, COLS))
    qw, qz, sc, gi = (parts[k] for k in ("qweight", "qzeros", "scales", "g_idx"))
    for e in range(n):
        for i in range(COLS):
            g = int(gi[e, i])
            for o in range(0, ROWS, 9):
                q = (int(qw[e, i // 8, o]) >> (4 * (i % 8))) & 0xF
                z = (int(qz[e, g, o // 8]) >> (4 * (o % 8))) & 0xF
                want[e, o, i] = float(sc[e, g, o]) * (q - (z + 1))
    got = SHIPPED_CODECS["gptq-int4"].decode(parts, ROWS, COLS)
    assert torch.equal(got[:, ::9], want[:, ::9])

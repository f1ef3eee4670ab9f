"""The runtime's Triton kernels compile for the H200 (sm_90) on a machine without a GPU, and the
memory orders their protocols rely on are in the PTX (`mapped`, `kernels.relay`)."""

from __future__ import annotations


import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from seqmoe.runtime.kernels import mapped as mapped_kernels  # noqa: E402
from seqmoe.runtime.kernels import relay as relay_kernels  # noqa: E402
from seqmoe.runtime.kernels import rerouting as rerouting_kernels  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)


def _ptx(fn, args: str, constexprs: dict) -> str:
    """PTX of `fn` for `args` ("name:type ..." in Triton's signature types)."""
    sig = dict(a.split(":") for a in args.split())
    sig.update({k: "constexpr" for k in constexprs})
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=H200).asm["ptx"]


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_the_relay_kernels_compile_for_sm90_with_their_memory_orders(dt):
    if not relay_kernels.available():
        pytest.skip("no triton with tl.atomic_load")
    k = relay_kernels._build()
    post = _ptx(k["post"], f"x:*{dt} index:*i64 weights:*fp32 posts:*i64 rx:*{dt} rindex:*i64 rweights:*fp64 "
                "xseq:*i64 layer:i32 L:i32 R:i32 H:i32 K:i32 SH:i32 SK:i32", {"BH": 1024, "BK": 8})
    keep = _ptx(k["keep"], f"index:*i64 weights:*{dt} posts:*i64 on_host:*u8 dseq:*i64 status:*i64 kept:*{dt} "
                "skip:*i8 fell:*i32 hrow:*i32 hids:*i64 layer:i32 L:i32 R:i32 E:i32 K:i32 SPINS:i32",
                {"BK": 8, "HAS_ROWS": True})
    add = _ptx(k["add"], f"out:*{dt} host_out:*{dt} posts:*i64 oseq:*i64 status:*i64 fell:*i32 layer:i32 L:i32 "
               "R:i32 H:i32 SH:i32 SPINS:i32", {"BH": 1024})
    flag = post.index("st.relaxed.sys")  # a release store: a system fence, then the store
    assert "fence.release.sys" in post[:flag] and "bar.sync" in post[:flag]
    for name, ptx in (("keep", keep), ("add", add)):
        poll = ptx.index("ld.relaxed.sys")  # an acquire load: the load, then a system fence
        assert ptx.index("fence.acquire.sys", poll) < ptx.index("ld.volatile.global", poll), name
        assert "atom.global.sys" in ptx  # the device's counts (device-written words only)


def test_the_gather_and_mailbox_kernels_compile_for_sm90():
    k = mapped_kernels.build()
    _ptx(k["resolve"], "table:*i32 ids:*i64 skip:*i1 slots:*i32 reads:*i64 K:i32", {"HAS_SKIP": True, "BK": 8})
    _ptx(k["gather"], "pool:*bf16 host:*bf16 slots:*i32 ids:*i64 out:*bf16 P:i32", {"BLOCK": 1024})
    _ptx(k["gather"], "pool:*u8 host:*u8 slots:*i32 ids:*i64 out:*u8 P:i32", {"BLOCK": 1024})  # quantized rows
    post = _ptx(k["post"], "ids:*i64 weights:*fp32 token:*i64 posts:*i64 box_ids:*i32 box_w:*fp32 box_tok:*i64 "
                "box_seq:*i64 snap:*i64 version:*i64 acked:*i64 layer:i32 L:i32 R:i32 N:i32 W:i32 NT:i32 TW:i32",
                {"HAS_TOKEN": True, "HAS_FENCE": True, "BK": 32, "BT": 4})  # a step of 4 rows of K = 8
    assert "atom.global.sys.release.exch" in post


def test_the_cache_aware_routing_kernel_compiles_for_sm90():
    _ptx(rerouting_kernels._build(), "logits:*fp32 weights:*bf16 ids:*i64 assigned:*u8 table:*i32 state:*fp64 "
         "counts:*fp64 out_w:*bf16 out_ids:*i64 layer:i32 E:i32 K:i32 B:i32", {"BE": 64, "BK": 8})


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_dequantizing_gather_compiles_for_sm90_and_rounds_to_nearest(mode):
    """int8 (0), int4 (1) and raw (2) parts into bf16 weights; the float32 product is rounded to
    bf16 to nearest even, as torch's `.to(torch.bfloat16)` does."""
    ptx = _ptx(mapped_kernels.build()["dequant_gather"], "pool:*u8 host:*u8 slots:*i32 ids:*i64 out:*bf16 B:i32 "
               "offset:i32 code_bytes:i32 numel:i32", {"MODE": mode, "GROUP": 64, "BLOCK": 1024})
    assert mode == 2 or "cvt.rn.bf16.f32" in ptx or "cvt.rn.bf16x2.f32" in ptx


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_shipped_gather_compiles_for_sm90_and_rounds_to_nearest(mode, transpose):
    """FP8 blocks (0), MXFP4 (1) and Q8_0 (2) linears into bf16 weights, straight or transposed (gpt-oss)."""
    ptx = _ptx(mapped_kernels.build()["shipped_gather"], "pool:*u8 host:*u8 slots:*i32 ids:*i64 out:*bf16 B:i32 "
               "code_off:i32 scale_off:i32 R:i32 C:i32 out_numel:i32 out_base:i32 FB:i32",
               {"MODE": mode, "TRANSPOSE": transpose, "BLOCK": 1024})
    assert "cvt.rn.bf16.f32" in ptx or "cvt.rn.bf16x2.f32" in ptx

"""The Triton kernels of a posted step over mapped host memory (`seqmoe.runtime.core.mapped`):
`resolve` reads the K routed experts' slot-table entries (volatile: the host writes the table),
`gather` copies each routed row from its slot or its host block, `dequant_gather` reads one
parameter of each routed quantized row (`seqmoe.arch.quant`: int8 or int4 codes and their float32
scales, or a raw vector) from its slot or host block and writes it dequantized, `post` writes one
layer's routing into the mailbox and acknowledges the slot table's version (`posted.mailbox`,
`posted.fence`).
`kernels()` builds them once; None without triton (torch ops then do the same, slower).
"""

from __future__ import annotations

import warnings

BLOCK = 1024
"""Columns of a row one program of the gather copies."""
_KERNELS: dict | None = None
_TRIED = False


def kernels() -> dict | None:
    """The Triton kernels, built once; None (torch ops instead, slower: a miss-tolerant gather then
    reads every routed row from the host too) when triton is missing."""
    global _KERNELS, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            _KERNELS = build()
        except ImportError:
            warnings.warn("triton is not installed: the CUDA decode step uses slower torch ops (pip install triton)",
                          stacklevel=3)
    return _KERNELS


def build() -> dict:
    import triton  # triton: only when this runs
    import triton.language as tl  # triton: only when this runs

    @triton.jit
    def resolve(table, ids, skip, slots, reads, K, HAS_SKIP: tl.constexpr, BK: tl.constexpr):
        k = tl.arange(0, BK)
        m = k < K
        e = tl.load(ids + k, mask=m, other=0).to(tl.int64)
        s = tl.load(table + e, mask=m, other=0, volatile=True)  # the host writes the table: no cached copy
        if HAS_SKIP:
            s = tl.where(tl.load(skip + k, mask=m, other=0) != 0, -2, s)
        tl.store(slots + k, s, mask=m)
        tl.atomic_add(reads, tl.sum((m & (s >= 0)).to(tl.int64), axis=0))
        tl.atomic_add(reads + 1, tl.sum((m & (s == -1)).to(tl.int64), axis=0))

    @triton.jit
    def gather(pool, host, slots, ids, out, P, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < P
        e = tl.load(ids + row).to(tl.int64)
        slot = tl.load(slots + row).to(tl.int64)
        if slot >= 0:
            vals = tl.load(pool + slot * P + cols, mask=mask)
            tl.store(out + row.to(tl.int64) * P + cols, vals, mask=mask)
        elif slot == -1:
            vals = tl.load(host + e * P + cols, mask=mask)
            tl.store(out + row.to(tl.int64) * P + cols, vals, mask=mask)
        else:  # skipped: nothing is read
            tl.store(out + row.to(tl.int64) * P + cols, tl.zeros((BLOCK,), tl.float32), mask=mask)

    @triton.jit
    def dequant_gather(pool, host, slots, ids, out, B, offset, code_bytes, numel, MODE: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr):
        # out [K, numel]: the part at byte `offset` of each routed row [B] uint8, dequantized as
        # `QuantLayout.views` does (codes x their group's scale in float32, then out's dtype).
        # MODE 0: int8 codes, 1: int4 codes (two a byte, the even one low, +8), 2: raw values;
        # GROUP: weights per scale.
        row = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = j < numel
        e = tl.load(ids + row).to(tl.int64)
        slot = tl.load(slots + row).to(tl.int64)
        dst = out + row.to(tl.int64) * numel + j
        if slot == -2:  # skipped: nothing is read
            tl.store(dst, tl.zeros((BLOCK,), tl.float32).to(out.dtype.element_ty), mask=m)
        else:
            if slot >= 0:
                src = pool + slot * B + offset
            else:
                src = host + e * B + offset
            if MODE == 2:
                vals = tl.load(src.to(tl.pointer_type(out.dtype.element_ty)) + j, mask=m)
                tl.store(dst, vals, mask=m)
            else:
                if MODE == 0:
                    q = tl.load(src + j, mask=m).to(tl.int8, bitcast=True).to(tl.float32)
                else:
                    byte = tl.load(src + j // 2, mask=m).to(tl.int32)
                    q = (((byte >> ((j % 2) * 4)) & 15) - 8).to(tl.float32)
                scale = tl.load((src + code_bytes).to(tl.pointer_type(tl.float32)) + j // GROUP, mask=m)
                tl.store(dst, (q * scale).to(out.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["layer"])
    def post(ids, weights, token, posts, box_ids, box_w, box_tok, box_seq, snap, version, acked, layer, L, R, N, W,
             NT, TW, HAS_TOKEN: tl.constexpr, HAS_FENCE: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr):
        # N routed entries (rows x K) into a mailbox row W wide; NT input tokens into a row TW wide
        n = tl.load(posts)
        if HAS_FENCE:
            prev = tl.load(snap)  # loaded by every thread before the barrier below, stored after it
        step = n // L
        at = (step % R) * L + layer
        k = tl.arange(0, BK)
        m = k < N
        tl.store(box_ids + at * W + k, tl.load(ids + k, mask=m).to(tl.int32), mask=m)
        tl.store(box_w + at * W + k, tl.load(weights + k, mask=m).to(tl.float32), mask=m)
        if HAS_TOKEN:
            t = tl.arange(0, BT)
            mt = t < NT
            tl.store(box_tok + (step % R) * TW + t, tl.load(token + t, mask=mt).to(tl.int64), mask=mt)
        tl.debug_barrier()  # every thread's routing stores happen before the release below
        tl.atomic_xchg(box_seq + at, step, sem="release", scope="sys")  # the host sees routing, then the number
        tl.store(posts, n + 1)
        if HAS_FENCE:  # the previous layer's reads are done (stream order): acknowledge, then snapshot
            tl.atomic_xchg(acked, prev, sem="release", scope="sys")
            tl.store(snap, tl.load(version, volatile=True))

    return {"resolve": resolve, "gather": gather, "dequant_gather": dequant_gather, "post": post}

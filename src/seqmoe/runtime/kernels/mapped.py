"""The Triton kernels of a posted step over mapped host memory (`seqmoe.runtime.core.mapped`):
`resolve` reads the K routed experts' slot-table entries (volatile: the host writes the table),
`gather` copies each routed row from its slot or its host block, `dequant_gather` reads one
parameter of each routed quantized row (`seqmoe.arch.quant`: int8 or int4 codes and their float32
scales, or a raw vector) from its slot or host block and writes it dequantized, `shipped_gather` does
the same for one linear of a shipped format's row (`seqmoe.arch.shipped_layout`: FP8 blocks, MXFP4,
Q8_0, decoded by their formulas in float32), `post` writes one
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

    @triton.jit
    def shipped_gather(pool, host, slots, ids, out, B, code_off, scale_off, R, C, out_numel, out_base, FB,
                       MODE: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr):
        # The linear [R, C] whose tensors start at byte code_off (codes) and scale_off (scales) of each
        # routed row, decoded into out [K, out_numel] at out_base (+ i * C + j, or with TRANSPOSE
        # j * R + i: gpt-oss's [inputs, outputs]). MODE 0: fp8 e4m3 codes, a float32 scale per FB x FB
        # block (edge blocks partial); 1: MXFP4 (two e2m1 codes a byte, the even one low, an E8M0 byte per
        # 32); 2: Q8_0 blocks of 34 bytes (a float16 scale, 32 int8 codes). Skipped rows (slot -2) are zero.
        row = tl.program_id(0)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = idx < R * C
        i, j = idx // C, idx % C
        e = tl.load(ids + row).to(tl.int64)
        slot = tl.load(slots + row).to(tl.int64)
        at = out_base + (j * R + i if TRANSPOSE else idx)
        dst = out + row.to(tl.int64) * out_numel + at
        if slot == -2:
            tl.store(dst, tl.zeros((BLOCK,), tl.float32).to(out.dtype.element_ty), mask=m)
        else:
            if slot >= 0:
                src = pool + slot * B
            else:
                src = host + e * B
            if MODE == 0:
                b = tl.load(src + code_off + idx, mask=m).to(tl.int32)
                ex, mant = (b >> 3) & 15, (b & 7).to(tl.float32)
                mag = tl.where(ex == 0, mant * 0.001953125, (8.0 + mant) * tl.exp2((ex - 10).to(tl.float32)))
                q = tl.where((b & 128) != 0, -mag, mag)
                grid = (C + FB - 1) // FB
                scale = tl.load((src + scale_off).to(tl.pointer_type(tl.float32)) + (i // FB) * grid + j // FB, mask=m)
            elif MODE == 1:
                b = tl.load(src + code_off + idx // 2, mask=m).to(tl.int32)
                nib = (b >> ((j % 2) * 4)) & 15
                ex, mant = (nib >> 1) & 3, (nib & 1).to(tl.float32)
                mag = tl.where(ex == 0, mant * 0.5, (2.0 + mant) * tl.exp2((ex - 2).to(tl.float32)))
                q = tl.where((nib & 8) != 0, -mag, mag)
                sb = tl.load(src + scale_off + i * (C // 32) + j // 32, mask=m).to(tl.int32)
                scale = tl.exp2((sb - 127).to(tl.float32))
            else:
                blk = src + code_off + i * (C // 32 * 34) + (j // 32) * 34
                lo, hi = tl.load(blk, mask=m).to(tl.int32), tl.load(blk + 1, mask=m).to(tl.int32)
                scale = ((hi << 8) | lo).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                q = tl.load(blk + 2 + j % 32, mask=m).to(tl.int8, bitcast=True).to(tl.float32)
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

    return {"resolve": resolve, "gather": gather, "dequant_gather": dequant_gather, "shipped_gather": shipped_gather,
            "post": post}

"""The Triton kernels of `mapped` against the torch ops, on the CPU under TRITON_INTERPRET=1.

    python -m tests.runtime.triton_interp_check      # prints "ok"; run by test_thread.py when triton is installed
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

from seqmoe.runtime.core import mapped  # noqa: E402
from seqmoe.runtime.kernels import mapped as mapped_kernels  # noqa: E402
from seqmoe.runtime.posted.fence import ReadFence  # noqa: E402
from seqmoe.runtime.posted.mailbox import Mailbox  # noqa: E402


def check_resolve_and_gather(k: dict) -> None:
    pool = torch.arange(3 * 3000, dtype=torch.float32).view(3, 3000)
    host = -torch.arange(5 * 3000, dtype=torch.float32).view(5, 3000)
    table = torch.tensor([0, 2, -1, -1, 1], dtype=torch.int32)
    ids, reads = torch.tensor([4, 3, 0]), torch.zeros(2, dtype=torch.int64)
    slots, out = torch.empty(3, dtype=torch.int32), torch.empty(3, 3000)
    k["resolve"][(1,)](table, ids, ids, slots, reads, 3, HAS_SKIP=False, BK=4)
    k["gather"][(3, -(-3000 // 1024))](pool, host, slots, ids, out, 3000, BLOCK=1024)
    assert slots.tolist() == [1, -1, 0] and reads.tolist() == [2, 1]
    assert torch.equal(out, torch.stack([pool[1], host[3], pool[0]]))
    skip = torch.tensor([False, True, False])  # the host computes the second: neither source is read
    k["resolve"][(1,)](table, ids, skip, slots, reads, 3, HAS_SKIP=True, BK=4)
    k["gather"][(3, -(-3000 // 1024))](pool, host, slots, ids, out, 3000, BLOCK=1024)
    assert slots.tolist() == [1, -2, 0] and reads.tolist() == [4, 1]
    assert torch.equal(out, torch.stack([pool[1], torch.zeros(3000), pool[0]]))
    want_slots, want_reads = torch.empty(3, dtype=torch.int32), torch.tensor([2, 1])
    mapped._resolve(table, ids, skip, want_slots, want_reads)  # the torch ops agree
    assert torch.equal(want_slots, slots) and want_reads.tolist() == [4, 1]


def check_quantized_gather(k: dict) -> None:
    """Rows of a quantized store (uint8: int4 codes and float32 scales) cross the gather byte for byte,
    so the dequantized weights of the step are those the torch path gives."""
    from seqmoe.arch.quant import QuantLayout
    from tests.runtime.conftest import fresh
    from seqmoe.arch import model_arch

    arch = model_arch(fresh("olmoe"))
    experts = arch.moe[0].experts
    layout = QuantLayout.of(arch.layout(experts), "int4")
    host = torch.empty((experts.num_experts, layout.numel), dtype=torch.uint8)
    layout.pack(experts, host)
    pool = host[[2, 5]].clone()
    table = torch.full((experts.num_experts,), -1, dtype=torch.int32)
    table[5], table[2] = 1, 0
    ids, reads = torch.tensor([5, 1, 2]), torch.zeros(2, dtype=torch.int64)
    got, want = torch.empty(3, layout.numel, dtype=torch.uint8), torch.empty(3, layout.numel, dtype=torch.uint8)
    slots = torch.empty(3, dtype=torch.int32)
    k["resolve"][(1,)](table, ids, ids, slots, reads, 3, HAS_SKIP=False, BK=4)
    k["gather"][(3, -(-layout.numel // 1024))](pool, host, slots, ids, got, layout.numel, BLOCK=1024)
    mapped.gather_rows(pool, host, table, ids, want, torch.zeros(2, dtype=torch.int64))
    assert torch.equal(got, want) and torch.equal(got, host[ids])
    assert all(torch.equal(a, b) for a, b in zip(layout.views(got).values(), layout.views(host[ids]).values()))


def check_dequant_gather() -> None:
    """`gather_dequantized` (one kernel per parameter: codes and scales read from the slot or the host
    row) gives what `QuantLayout.views` gives of the gathered rows: int8 and int4 codes, raw vectors
    (GPT-OSS's biases), a skipped position as zeros; bit for bit in float32. In bfloat16 within one
    bf16 step: the interpreter casts float32 to bfloat16 by truncation, where the GPU rounds to nearest
    even as torch does (test_kernels_compile checks the PTX's cvt.rn)."""
    from seqmoe.arch import model_arch
    from seqmoe.arch.quant import QuantLayout
    from tests.runtime.conftest import fresh

    for arch_name, dtype in (("olmoe", torch.float32), ("gpt_oss", torch.float32), ("gpt_oss", torch.bfloat16)):
        arch = model_arch(fresh(arch_name).to(dtype))
        experts = arch.moe[0].experts
        for precision in mapped.DEQUANT_MODES:
            layout = QuantLayout.of(arch.layout(experts), precision)
            host = torch.empty((experts.num_experts, layout.numel), dtype=torch.uint8)
            layout.pack(experts, host)
            pool = host[[2, 5]].clone()
            table = torch.full((experts.num_experts,), -1, dtype=torch.int32)
            table[5], table[2] = 1, 0
            ids, skip = torch.tensor([5, 1, 2]), torch.tensor([False, False, True])
            outs = {part.name: torch.empty((3, int(np.prod(part.shape))), dtype=dtype) for part in layout.parts}
            reads, slots = torch.zeros(2, dtype=torch.int64), torch.empty(3, dtype=torch.int32)
            got = mapped.gather_dequantized(pool, host, table, ids, layout, outs, reads, slots, skip)
            want = layout.views(host[ids])
            assert reads.tolist() == [1, 1], reads
            for name, w in want.items():
                w[2] = 0
                assert got[name].dtype == dtype, (arch_name, precision, name)
                if dtype == torch.float32:
                    assert torch.equal(got[name], w), (arch_name, precision, name)
                else:
                    step = torch.finfo(torch.bfloat16).eps * w.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
                    assert ((got[name].float() - w.float()).abs() <= step).all(), (arch_name, precision, name)


def check_shipped_gather() -> None:
    """`gather_dequantized` of a shipped layout (one kernel per linear, decoding FP8 blocks, MXFP4 and
    Q8_0 by their formulas, each into its place in its parameter, transposed for gpt-oss) gives what
    `ShippedLayout.views` gives of the gathered rows, bit for bit in float32; a skipped position zeros."""
    from seqmoe.arch import model_arch
    from seqmoe.arch.quant import store_layout
    from tests.runtime.conftest import fresh

    cases = (("olmoe", "fp8-block"), ("olmoe", "fp8-block-16"), ("mixtral", "mxfp4"), ("gpt_oss", "mxfp4"),
             ("gpt_oss", "q8_0"),
             ("mixtral", "q8_0/mxfp4/fp8-block"))
    for arch_name, precision in cases:
        arch = model_arch(fresh(arch_name))
        experts = arch.moe[0].experts
        layout = store_layout(arch.layout(experts), precision)
        assert mapped.reads_in_kernel(layout), precision
        host = torch.empty((experts.num_experts, layout.numel), dtype=torch.uint8)
        layout.pack(experts, host)
        pool = host[[2, 5]].clone()
        table = torch.full((experts.num_experts,), -1, dtype=torch.int32)
        table[5], table[2] = 1, 0
        ids, skip = torch.tensor([5, 1, 2]), torch.tensor([False, False, True])
        outs = {n: torch.empty((3, int(np.prod(s)))) for n, s in zip(layout.names, layout.shapes)}
        reads, slots = torch.zeros(2, dtype=torch.int64), torch.empty(3, dtype=torch.int32)
        got = mapped.gather_dequantized(pool, host, table, ids, layout, outs, reads, slots, skip)
        assert reads.tolist() == [1, 1], reads
        for name, w in layout.views(host[ids]).items():
            w[2] = 0
            assert torch.equal(got[name], w), (arch_name, precision, name, (got[name] - w).abs().max())


def _posted(k: dict | None, rows: int = 1) -> tuple:
    fence = ReadFence(torch.device("cpu"))
    box = Mailbox(2, 3, torch.device("cpu"), fence, ring=4, rows=4)
    for step in range(5):
        for layer in range(2):
            fence.publish(10 * step + layer)
            ids = torch.tensor([[step, layer, 7]]) + 10 * torch.arange(rows).view(rows, 1)
            w = torch.tensor([[0.5, 0.25, 0.25]]).repeat(rows, 1)
            tok = 40 + step + 100 * torch.arange(rows) if layer == 0 else None
            if k is None:
                box.post(layer, ids, w, tok)
                continue
            k["post"][(1,)](ids.view(-1), w.view(-1), tok if tok is not None else ids.view(-1), box.posts, box._d_ids,
                            box._d_weights, box._d_tokens, box._d_seq, fence.snap, fence.version_dev, fence.acked_dev,
                            layer, 2, 4, 3 * rows, 3 * box.rows, rows, box.rows, HAS_TOKEN=tok is not None,
                            HAS_FENCE=True, BK=max(2, 1 << (3 * rows - 1).bit_length()),
                            BT=max(2, 1 << (rows - 1).bit_length()))
    return (box.ids_np, box.weights_np, box.tokens_np, box.seq_np, int(box.posts), fence.acked(), int(fence.snap))


def check_warm(k: dict) -> None:
    """The mailbox's warm-up posts leave nothing behind: the kernel's posts then equal the torch ops'."""
    fence = ReadFence(torch.device("cpu"))
    fence.publish(7)
    box = Mailbox(2, 3, torch.device("cpu"), fence, ring=4)
    box.kernel = k["post"]
    box.warm()
    assert int(box.posts) == 0 and (box.seq_np == -1).all() and fence.acked() == 0 and int(fence.snap) == 0
    box.post(0, torch.tensor([[1, 2, 3]]), torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.bfloat16), torch.tensor([9]))
    assert box.seq_np[0] == 0 and box.ids_np[0, :3].tolist() == [1, 2, 3] and int(box.tokens_np[0, 0]) == 9
    assert int(fence.snap) == 7 and int(box.posts) == 1


def main() -> None:
    k = mapped_kernels.build()
    check_resolve_and_gather(k)
    check_quantized_gather(k)
    check_dequant_gather()
    check_shipped_gather()
    check_warm(k)
    for rows in (1, 3):  # a batched step's rows land where a one-row step's do, side by side
        got, want = _posted(k, rows), _posted(None, rows)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want)), (rows, got, want)
        assert want[4:] == (10, 40, 41)
        ids, tokens = want[0], want[2]
        assert ids[1, : 3 * rows].tolist() == sum(([4 + 10 * r, 1 + 10 * r, 7 + 10 * r] for r in range(rows)), [])
        assert tokens[0, :rows].tolist() == [44 + 100 * r for r in range(rows)]  # step 4 in ring slot 0, as its ids
    print("ok")


if __name__ == "__main__":
    main()

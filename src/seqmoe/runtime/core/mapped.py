"""Host memory the device reads and writes in place, and the miss-tolerant gather of expert rows.

On CUDA, pinned host memory (`torch.empty(..., pin_memory=True)`, allocated with cudaHostAlloc) is
mapped into the device's address space under unified virtual addressing: a kernel can read and
write it through the same pointer, over the host link, with no copy issued by the host.
`device_view` wraps such a tensor as a CUDA tensor of the same memory (through
`__cuda_array_interface__`), so ordinary torch ops (and kernels) running in the decode step can
read the slot table and the host expert rows and write the routing mailbox without the host taking
part. On the CPU the host memory *is* the device memory: `device_view` returns the tensor itself.

`gather_rows(pool, host, table, ids, out, reads)` writes, for each routed expert i, its packed row
from its pool slot when the slot table says it has one, else straight from its host row: a miss is
served by the device reading host memory, never by waiting for the host. It first resolves the K
table entries into device memory (one small kernel, reading the mapped table once per row with
volatile loads), then gathers (the slot fence relies on that order: docs/decode.md). `post_kernel`
writes one layer's routing into the mailbox and acknowledges the table version
(`posted.mailbox.Mailbox.post`, `posted.fence`). On CUDA each step is a Triton kernel
(`seqmoe.runtime.kernels.mapped`; the gather reads only the chosen source of each row); elsewhere,
or without triton, torch ops with the same result. Checked against each other on CUDA
(tests/runtime/test_thread.py) and here under `TRITON_INTERPRET=1`.

`gather_dequantized` is the gather for an int8 or int4 store, or a shipped format's (FP8 blocks,
MXFP4, Q8_0 linears): one kernel per parameter (per linear) reads the codes and scales of each routed
row from its slot or host row and writes the weights dequantized, the numbers `views` gives of the
gathered rows, with no pass over a gathered copy.
"""

from __future__ import annotations

import functools

import torch

from seqmoe.arch.shipped import SHIPPED_CODECS
from seqmoe.base.errors import UserError
from seqmoe.costs.precision import GROUP
from seqmoe.runtime.kernels import mapped as mapped_kernels


class _CudaArray:
    """The `__cuda_array_interface__` of pinned host memory (torch then reads its device from the pointer)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # kept alive as long as the view (torch holds a reference to this object)
        typestr = {torch.float64: "<f8", torch.float32: "<f4", torch.float16: "<f2", torch.int32: "<i4",
                   torch.int64: "<i8", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1"}.get(host.dtype)
        if typestr is None:  # bfloat16 has no typestr: viewed as int16 and reinterpreted by the caller
            raise TypeError(f"no array-interface type for {host.dtype}")
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": typestr,
                                         "data": (host.data_ptr(), False), "version": 3,
                                         "strides": tuple(s * host.element_size() for s in host.stride())}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` as a tensor on `device` sharing its memory: itself on the CPU; on CUDA a mapped view of
    the pinned `host` (UserError if it is not pinned)."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        raise UserError(f"device {device} is not supported by the runtime; use cpu or cuda")
    if not host.is_pinned():
        raise UserError("host memory read by the device must be pinned (torch.empty(..., pin_memory=True))")
    if host.dtype == torch.bfloat16:
        return device_view(host.view(torch.int16), device).view(torch.bfloat16)
    with torch.cuda.device(device):
        view = torch.as_tensor(_CudaArray(host), device=device)
    if view.device.type != "cuda" or view.data_ptr() != host.data_ptr():
        raise RuntimeError("the mapped view of pinned host memory does not alias it (no unified addressing?)")
    return view


def gather_rows(pool: torch.Tensor, host: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                reads: torch.Tensor, slots: torch.Tensor | None = None, skip: torch.Tensor | None = None,
                host_ids: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = pool[table[ids[i]]] when that slot is >= 0, else host[host_ids[i]] (default: `ids`), or
    zeros where `skip` [n] bool (rows nobody needs: nothing is read); reads[0] += slot reads, reads[1]
    += host reads. `host` and `table` as the device sees them (`device_view`); `slots` [n] int32 device
    scratch, given the resolved entries (-1: from the host, -2: skipped; allocated when None)."""
    n, p = out.shape
    if slots is None:
        slots = torch.empty((n,), dtype=torch.int32, device=out.device)
    k = mapped_kernels.kernels() if out.device.type == "cuda" else None
    if k is not None:
        k["resolve"][(1,)](table, ids, skip if skip is not None else ids, slots, reads, n,
                           HAS_SKIP=skip is not None, BK=max(2, 1 << (n - 1).bit_length()))
        k["gather"][(n, -(-p // mapped_kernels.BLOCK))](pool, host, slots, ids if host_ids is None else host_ids, out,
                                                         p, BLOCK=mapped_kernels.BLOCK)
        return out
    _resolve(table, ids, skip, slots, reads)
    hit = (slots >= 0).unsqueeze(1)
    if host_ids is not None and bool(((slots == -1) & (host_ids < 0)).any()):  # the CPU path may read a value
        raise RuntimeError("a posted step missed an expert whose host-cache row was not held for it; this is a bug: "
                           "restore() and offload the model again")
    rows = ids if host_ids is None else host_ids.clamp(min=0)
    torch.where(hit, pool.index_select(0, slots.clamp(min=0).long()), host.index_select(0, rows), out=out)
    if skip is not None:
        out.masked_fill_(skip.unsqueeze(1), 0)
    return out


DEQUANT_MODES = {"int8": 0, "int4": 1}
"""Store precisions `gather_dequantized` reads (fp8 stores are gathered, then dequantized by torch ops)."""
SHIPPED_MODES = {"fp8-block": 0, "mxfp4": 1, "q8_0": 2}
"""Shipped formats whose linears `gather_dequantized` decodes (the others are gathered, then decoded by torch ops)."""


def dequantizes(layout, device: torch.device) -> bool:
    """`gather_dequantized` serves rows of `layout` on `device` (CUDA with triton, an int8 or int4 store,
    or a shipped layout whose linears are all in `SHIPPED_MODES`)."""
    return device.type == "cuda" and reads_in_kernel(layout) and mapped_kernels.kernels() is not None


def reads_in_kernel(layout) -> bool:
    """Whether the dequantizing gather's kernels decode every part of `layout`'s rows."""
    if getattr(layout, "matrices", None) is not None:
        return _shipped_launches(layout) is not None
    return getattr(layout, "precision", None) in DEQUANT_MODES


@functools.lru_cache(maxsize=32)
def _shipped_launches(layout) -> tuple | None:
    """Per parameter of a `ShippedLayout`, the fixed arguments of its kernels (worked out once per layout,
    not at every step): (name, vector offset or None, ((code offset, scale offset, rows, cols, out base,
    block, mode), ...)); None when some linear's format has no kernel."""
    out = []
    for name, shape in zip(layout.names, layout.shapes):
        linears = []
        for _, piece, r, c, f in (m for m in layout.matrices if m[0] == name):
            codec = SHIPPED_CODECS[f]
            if codec.kind not in SHIPPED_MODES:
                return None
            suffixes = list(codec.tensors(r, c))  # codes first, scales last (Q8_0: one tensor)
            linears.append((layout.part(name, piece, suffixes[0])[0], layout.part(name, piece, suffixes[-1])[0],
                            r, c, piece * r * c, codec.block, SHIPPED_MODES[codec.kind]))
        out.append((name, layout.part(name, -1, "")[0] if len(shape) < 2 else None, tuple(linears)))
    return tuple(out)


def gather_dequantized(pool: torch.Tensor, host: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, layout,
                       outs: dict[str, torch.Tensor], reads: torch.Tensor, slots: torch.Tensor,
                       skip: torch.Tensor | None = None, host_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """{name: [n, *shape]}: each parameter of the routed quantized rows (`layout`, a `QuantLayout` or a
    `ShippedLayout` that `reads_in_kernel`),
    dequantized from the slot or the host row as `gather_rows` would pick it (zeros where `skip`),
    written into `outs[name]` ([n, numel] of the compute dtype); reads counted as `gather_rows` does."""
    k = mapped_kernels.kernels()
    n = ids.shape[0]
    k["resolve"][(1,)](table, ids, skip if skip is not None else ids, slots, reads, n,
                       HAS_SKIP=skip is not None, BK=max(2, 1 << (n - 1).bit_length()))
    if getattr(layout, "matrices", None) is not None:
        return _gather_shipped(k, pool, host, slots, ids if host_ids is None else host_ids, layout, outs)
    mode, params = DEQUANT_MODES[layout.precision], {}
    for part in layout.parts:
        out = outs[part.name]
        numel = out.shape[1]
        k["dequant_gather"][(n, -(-numel // mapped_kernels.BLOCK))](
            pool, host, slots, ids if host_ids is None else host_ids, out, layout.numel, part.offset, part.code_bytes, numel,
            MODE=mode if part.code_bytes else 2, GROUP=GROUP, BLOCK=mapped_kernels.BLOCK)
        params[part.name] = out.view(n, *part.shape)
    return params


def _gather_shipped(k, pool, host, slots, ids, layout, outs) -> dict[str, torch.Tensor]:
    """`gather_dequantized` of a `ShippedLayout`: each linear decoded into its place in its parameter
    (gate then up; transposed in a family of [inputs, outputs] matrices), each vector copied."""
    n, params, B = ids.shape[0], {}, mapped_kernels.BLOCK
    for (name, at, linears), shape in zip(_shipped_launches(layout), layout.shapes):
        out, numel = outs[name], outs[name].shape[1]
        if at is not None:
            k["dequant_gather"][(n, -(-numel // B))](pool, host, slots, ids, out, layout.numel, at, 0, numel, MODE=2,
                                                    GROUP=GROUP, BLOCK=B)
        for code_off, scale_off, r, c, base, block, mode in linears:
            k["shipped_gather"][(n, -(-(r * c) // B))](
                pool, host, slots, ids, out, layout.numel, code_off, scale_off, r, c, numel, base, block,
                MODE=mode, TRANSPOSE=layout.base.in_out, BLOCK=B)
        params[name] = out.view(n, *shape)
    return params


def _resolve(table: torch.Tensor, ids: torch.Tensor, skip: torch.Tensor | None, slots: torch.Tensor,
                  reads: torch.Tensor) -> None:
    """The resolve kernel's result with torch ops: slots[i] = table[ids[i]] (-2 where skipped), reads counted."""
    torch.index_select(table, 0, ids, out=slots)
    if skip is not None:
        slots.masked_fill_(skip, -2)
    reads[:1].add_((slots >= 0).sum())
    reads[1:].add_((slots == -1).sum())


def post_kernel(device: torch.device):
    """The Triton kernel of `Mailbox.post` on CUDA, or None (then torch ops do the same)."""
    k = mapped_kernels.kernels() if device.type == "cuda" else None
    return k["post"] if k is not None else None

"""Host memory the device reads and writes in place, and the miss-tolerant gather of expert rows.

On CUDA, pinned host memory (`torch.empty(..., pin_memory=True)`, allocated with cudaHostAlloc) is
mapped into the device's address space under unified virtual addressing: a kernel can read and
write it through the same pointer, over the host link, with no copy issued by the host.
`device_view` wraps such a tensor as a CUDA tensor of the same memory (through
`__cuda_array_interface__`), so ordinary torch ops (and kernels) running in the decode step can
read the slot table and the host expert rows and write the routing mailbox without the host taking
part. On the CPU the host memory *is* the device memory: `device_view` returns the tensor itself.

`gather_rows(pool, host, slots, ids, out)` writes, for each routed expert i, its packed row from
its pool slot when `slots[i] >= 0`, else straight from its host row: a miss is served by the
device reading host memory, never by waiting for the host. On CUDA this is one Triton kernel that
reads only the chosen source of each row; elsewhere a torch composition with the same result.
"""

from __future__ import annotations

import torch

from seqmoe.errors import UserError


class _CudaArray:
    """The `__cuda_array_interface__` of pinned host memory (torch then reads its device from the pointer)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # kept alive as long as the view (torch holds a reference to this object)
        typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.int32: "<i4", torch.int64: "<i8",
                   torch.int16: "<i2", torch.uint8: "|u1"}.get(host.dtype)
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
        try:
            view = torch.as_tensor(_CudaArray(host), device=device)
        except (RuntimeError, TypeError) as e:
            view = _cupy_view(host, device, e)
    if view.device.type != "cuda" or view.data_ptr() != host.data_ptr():
        raise RuntimeError("the mapped view of pinned host memory does not alias it (no unified addressing?)")
    return view


def _cupy_view(host: torch.Tensor, device: torch.device, why: BaseException) -> torch.Tensor:
    """The same view built by CuPy and handed over by DLPack, where torch refuses the interface."""
    try:
        import cupy
    except ImportError:
        raise RuntimeError(f"torch does not wrap pinned host memory as a CUDA tensor here ({why}); "
                           "installing cupy gives another way") from why
    mem = cupy.cuda.UnownedMemory(host.data_ptr(), host.numel() * host.element_size(), host, device.index or 0)
    arr = cupy.ndarray(tuple(host.shape), dtype=str(host.dtype).removeprefix("torch."),
                       memptr=cupy.cuda.MemoryPointer(mem, 0),
                       strides=tuple(s * host.element_size() for s in host.stride()))
    view = torch.from_dlpack(arr)
    view._seqmoe_host = host  # keep the pinned memory alive with the view
    return view


def gather_rows(pool: torch.Tensor, host: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """out[i] = pool[slots[i]] if slots[i] >= 0 else host[ids[i]]; `host` as seen by the device (`device_view`)."""
    if out.device.type == "cuda":
        _gather_rows_cuda(pool, host, slots, ids, out)
    else:
        hit = (slots >= 0).unsqueeze(1)
        torch.where(hit, pool.index_select(0, slots.clamp(min=0).long()), host.index_select(0, ids.long()), out=out)
    return out


_KERNEL = None


def _gather_rows_cuda(pool, host, slots, ids, out) -> None:
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build_kernel()
    n, p = out.shape
    block = 1024
    _KERNEL[(n, triton_cdiv(p, block))](pool, host, slots, ids, out, p, BLOCK=block)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _build_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # CUDA torch ships triton; a custom build may not
        raise UserError("the CUDA runtime path needs triton (pip install triton) for the miss-tolerant expert gather") from e

    @triton.jit
    def gather(pool, host, slots, ids, out, P, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < P
        slot = tl.load(slots + row).to(tl.int64)
        if slot >= 0:
            vals = tl.load(pool + slot * P + cols, mask=mask)
        else:
            vals = tl.load(host + tl.load(ids + row).to(tl.int64) * P + cols, mask=mask)
        tl.store(out + row.to(tl.int64) * P + cols, vals, mask=mask)

    return gather

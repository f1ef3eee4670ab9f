"""What `offload` needs to change a model all-or-nothing: the device checks, the undo log, moving
the dense remainder of the model.

    device = resolve_device("cuda", model_device)       # UserError for meta, unknown or absent devices
    check_device_memory(model, experts, device, C, expert_bytes, L * E)   # before anything changes
    with Undo() as undo:                                 # on any error: every pushed step, in reverse
        undo.push(lambda: ...); move_model(model, device, undo); slots = allocate_slots(...)
"""

from __future__ import annotations

import os

import torch

from seqmoe.arch import ExpertLayout
from seqmoe.base.errors import UserError
from seqmoe.runtime.core.signals import deferred_interrupts

_GIB, _MIB = float(1 << 30), float(1 << 20)


def resolve_device(device, model_device: torch.device) -> torch.device:
    """The device the pool and the dense remainder will live on (default: where the experts are)."""
    try:
        device = torch.device(device) if device is not None else model_device
    except (RuntimeError, TypeError) as e:
        raise UserError(f"cannot use device {device!r} ({e}); pass 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {device} is not supported by the runtime; pass 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device} was asked for but CUDA is not available; pass device='cpu' or None")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise UserError(f"device {device} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_shortfall(device, capacity: int, expert_bytes: int, dense_bytes: int, available: int,
                     num_uids: int) -> str | None:
    """Why `capacity` slots of `expert_bytes` plus `dense_bytes` moving to `device` do not fit in
    `available` bytes (what is needed, what fits), or None when they fit."""
    need = capacity * expert_bytes + dense_bytes
    if need <= available:
        return None
    fit = max(available - dense_bytes, 0) // expert_bytes
    hint = (f"lower the residency to at most {fit / num_uids:.4g} ({fit} slots)" if fit else
            "the rest of the model alone does not fit")
    dense = f" + {dense_bytes / _GIB:.2f} GiB for the rest of the model" if dense_bytes else ""
    return (f"offload needs {need / _GIB:.2f} GiB on {device} ({capacity} slots x {expert_bytes / _MIB:.1f} MiB "
            f"for the expert pool{dense}) but {available / _GIB:.2f} GiB is free; {hint}, or free device memory")


FIT_MARGIN = 0.1
"""Share of the free device memory `pool_room` leaves free (the KV cache, activations, the
allocator's own blocks)."""


def host_available() -> int:
    """Bytes of host memory free for this process now: the kernel's MemAvailable (page cache it can
    drop included), else the free physical pages."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def dense_bytes(model, experts: list[torch.nn.Module]) -> int:
    """Bytes of `model`'s parameters and buffers outside the routed experts (meta tensors counted too)."""
    return _nbytes(_dense(model, experts))


def _dense(model, experts: list[torch.nn.Module]) -> list[torch.Tensor]:
    """`model`'s parameters and buffers outside the routed experts."""
    routed = {id(p) for x in experts for p in x.parameters(recurse=False)}
    return [p for p in model.parameters() if id(p) not in routed] + list(model.buffers())


def _room(model, experts: list[torch.nn.Module], device: torch.device) -> tuple[int, int]:
    """(bytes the device has for the pool and the dense remainder, bytes of the dense remainder that
    must move there): free memory, counting what the routed experts free there once packed."""
    free, _ = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    available += _nbytes(p for x in experts for p in x.parameters(recurse=False) if p.device == device)
    return available, _nbytes(t for t in _dense(model, experts) if t.device != device)


def check_device_memory(model, experts: list[torch.nn.Module], device: torch.device, capacity: int,
                        expert_bytes: int, num_uids: int) -> None:
    """UserError, before anything is allocated, when the pool and the dense remainder do not fit in
    `device`'s free memory."""
    available, dense = _room(model, experts, device)
    why = memory_shortfall(device, capacity, expert_bytes, dense, available, num_uids)
    if why is not None:
        raise UserError(why)


def pool_room(model, experts: list[torch.nn.Module], device: torch.device) -> int:
    """Bytes of `device`'s free memory an expert pool may take: what the dense remainder leaves,
    less `FIT_MARGIN` of the free memory."""
    available, dense = _room(model, experts, device)
    return max(0, int(available * (1 - FIT_MARGIN) - dense))


def move_model(model: torch.nn.Module, device: torch.device, undo: Undo) -> None:
    """`model.to(device)`, undoable: each parameter gets its old data and each buffer its old tensor back."""
    params = [(p, p.data) for p in model.parameters()]
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    if all(t.device == device for _, t in params) and all(b.device == device for _, _, b in buffers):
        return

    def back() -> None:
        for p, data in params:
            p.data = data
        for m, name, b in buffers:
            m._buffers[name] = b

    undo.push(back)
    model.to(device)


class Undo:
    """A log of undo steps, run in reverse if the `with` block raises anything (Ctrl-C included)."""

    def __init__(self) -> None:
        self._steps: list = []

    def push(self, step) -> None:
        self._steps.append(step)

    def __enter__(self) -> Undo:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        steps, self._steps = self._steps, []
        if kind is None:
            return False
        with deferred_interrupts():
            for step in reversed(steps):
                try:
                    step()
                except Exception as e:  # keep undoing: the error that started it is the one raised
                    error.add_note(f"undoing offload() also failed: {e!r}")
        return False


def _empty(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def allocate_slots(capacity: int, layout: ExpertLayout, device: torch.device, num_uids: int) -> torch.Tensor:
    """The [C, P] device pool; UserError saying what is needed if the device runs out of memory."""
    try:
        return _empty((capacity, layout.numel), layout.dtype, device)
    except torch.OutOfMemoryError:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        raise UserError(memory_shortfall(device, capacity, layout.expert_bytes, 0, free, num_uids) or
                        f"out of memory allocating {capacity} slots x {layout.expert_bytes / _MIB:.1f} MiB on "
                        f"{device}; lower the residency") from None

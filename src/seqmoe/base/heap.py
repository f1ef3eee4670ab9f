"""glibc's heap, tuned for a process that decodes: the per-layer buffers of a step (gathered expert
rows, decoded blocks: MiBs to tens of MiB) are freed and allocated again at every layer. Above
glibc's mmap threshold each one is a fresh mapping, page-faulted on first touch and unmapped on free,
which costs more than the work on it; `keep_freed_blocks` makes them heap blocks that are reused,
and `trim` hands the freed heap back when the work drains. Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 1 << 30
"""Allocations below this come from the heap (bigger ones, a host cache or a pool, stay mappings)."""
TRIM_THRESHOLD = 1 << 30
"""Freed memory at the top of the heap kept for reuse up to this much (`trim` returns it)."""


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
            return None
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # an int each: both thresholds fit in one
        return libc
    except OSError:
        return None


def keep_freed_blocks() -> bool:
    """Serve this process's step-sized allocations from the heap and keep what they free for the next
    (the command's own process only: it changes the allocator of the whole process). True when set."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def trim() -> None:
    """Hand the freed heap back to the OS (an idle server would hold its busiest moment's memory)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)

"""Reads of checkpoint byte ranges that keep the page cache out of the host cache's way.

    reader = DiskReader()                   # mode: DEFAULT_MODE (measured: docs/RESULTS.md)
    f = reader.open("model-00001.safetensors")
    view = reader.read(f, offset, nbytes)   # memoryview of a thread-local scratch buffer
    reader.read_into(f, offset, [mv1, mv2]) # scatter straight into the caller's buffers
    reader.close(f)

Two modes. "direct": `O_DIRECT`, the 4096-aligned span around the range read into a page-aligned
scratch buffer (an anonymous mmap), then the wanted bytes are the caller's to copy out. "buffered":
`pread`/`preadv` then `posix_fadvise(DONTNEED)` on the range, so the kernel drops the pages it just
filled. A file whose filesystem refuses O_DIRECT (tmpfs, EINVAL at open or at the first read) is
read buffered. Every read is positional and scratch buffers are per thread, so any number of
reader threads may share one `DiskReader`.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from dataclasses import dataclass, field

import numpy as np

ALIGN = 4096
"""O_DIRECT alignment of offsets, lengths and buffer addresses (the largest logical block size in use)."""
MODES = ("direct", "buffered")
DEFAULT_MODE = "direct"
"""Measured faster here for 17 MB expert reads (benchmarks/disk_read.py; docs/RESULTS.md)."""

_HAS_DIRECT = hasattr(os, "O_DIRECT")
_HAS_FADVISE = hasattr(os, "posix_fadvise")


class ShortRead(OSError):
    """The file ended before the requested range did (it was truncated)."""


@dataclass
class ReadFile:
    """One open checkpoint file: a buffered descriptor and, where the filesystem allows, an O_DIRECT one."""

    path: str
    fd: int
    direct_fd: int | None
    bytes_read: int = 0
    """Bytes delivered to callers (the wanted ranges, not the aligned spans)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class DiskReader:
    """Positional reads of byte ranges; thread-safe (per-thread scratch, positional syscalls)."""

    def __init__(self, mode: str | None = None):
        mode = mode or DEFAULT_MODE
        if mode not in MODES:
            raise ValueError(f"unknown read mode {mode!r}; choose from {', '.join(MODES)}")
        self.mode = mode
        self._local = threading.local()

    def open(self, path) -> ReadFile:
        """Open `path` for reading (OSError if it cannot be opened)."""
        path = os.fspath(path)
        fd = os.open(path, os.O_RDONLY)
        direct = None
        if self.mode == "direct" and _HAS_DIRECT:
            try:
                direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # tmpfs and some others refuse O_DIRECT at open: read buffered
                direct = None
        return ReadFile(path, fd, direct)

    def close(self, f: ReadFile) -> None:
        for fd in (f.fd, f.direct_fd):
            if fd is not None:
                os.close(fd)
        f.direct_fd = None

    def read(self, f: ReadFile, offset: int, nbytes: int) -> memoryview:
        """The bytes [offset, offset + nbytes) of `f`, in this thread's scratch buffer (valid until this
        thread's next `read`). ShortRead if the file ends first."""
        if f.direct_fd is not None:
            view = self._read_direct(f, offset, nbytes)
            if view is not None:
                return view
        buf = self._scratch(nbytes)
        view = memoryview(buf)[:nbytes]
        self._preadv(f, [view], offset, nbytes)
        return view

    def read_into(self, f: ReadFile, offset: int, views: list[memoryview]) -> None:
        """Scatter the bytes from `offset` into `views` in order, with no copy in between (buffered
        mode; a direct-mode reader reads the span then copies, O_DIRECT needs aligned buffers)."""
        nbytes = sum(v.nbytes for v in views)
        if f.direct_fd is not None:
            src = np.frombuffer(self.read(f, offset, nbytes), dtype=np.uint8)
            at = 0
            for v in views:  # numpy copies without the GIL (a memoryview assignment holds it)
                np.copyto(np.frombuffer(v, dtype=np.uint8), src[at:at + v.nbytes])
                at += v.nbytes
            return
        self._preadv(f, views, offset, nbytes)

    def _preadv(self, f: ReadFile, views: list[memoryview], offset: int, nbytes: int) -> None:
        views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        got = 0
        while got < nbytes:  # preadv may return fewer bytes than asked (signals, >2 GiB requests)
            n = os.preadv(f.fd, _skip(views, got), offset + got)
            if n == 0:
                raise ShortRead(errno.EIO, f"{f.path} ends before byte {offset + nbytes} (at {offset + got})")
            got += n
        if _HAS_FADVISE:  # drop the pages this read filled: the host cache, not the page cache, keeps experts
            os.posix_fadvise(f.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        _count(f, nbytes)

    def _read_direct(self, f: ReadFile, offset: int, nbytes: int) -> memoryview | None:
        start = offset - offset % ALIGN
        span = -(-(offset + nbytes - start) // ALIGN) * ALIGN
        buf = self._scratch(span)
        got = 0
        try:
            while got < span:
                n = os.preadv(f.direct_fd, [memoryview(buf)[got:span]], start + got)
                if n == 0 or n % ALIGN:  # end of file (a partial last block ends the file too)
                    got += n
                    break
                got += n
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            with f.lock:  # this filesystem accepts the O_DIRECT open but not the read: buffered from now on
                if f.direct_fd is not None:
                    os.close(f.direct_fd)
                    f.direct_fd = None
            return None
        if got < offset + nbytes - start:
            raise ShortRead(errno.EIO, f"{f.path} ends before byte {offset + nbytes} (at {start + got})")
        _count(f, nbytes)
        return memoryview(buf)[offset - start:offset - start + nbytes]

    def _scratch(self, nbytes: int) -> mmap.mmap:
        """This thread's page-aligned scratch buffer of at least `nbytes` (grown, never shrunk)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            if buf is not None:
                try:
                    buf.close()
                except BufferError:  # a caller still holds a view of the old one: leave it to the GC
                    pass
            buf = mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN))
            self._local.buf = buf
        return buf


def _count(f: ReadFile, nbytes: int) -> None:
    with f.lock:  # reader threads share the file: keep the count exact
        f.bytes_read += nbytes


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """`views` without their first `n` bytes (to resume a partial preadv)."""
    out = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:])
        n = 0
    return out

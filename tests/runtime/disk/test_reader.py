"""DiskReader: both modes return the file's bytes at unaligned ranges, refuse reads past the end, fall
back to buffered reads where O_DIRECT is refused, and keep one scratch buffer per thread."""

import errno
import os
import threading

import numpy as np
import pytest

from seqmoe.runtime.disk import reader as reader_mod
from seqmoe.runtime.disk.reader import ALIGN, DiskReader, ShortRead


@pytest.fixture
def blob(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 5 * ALIGN + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    return path, data


RANGES = [(0, 10), (3, ALIGN), (ALIGN - 1, 2), (ALIGN, ALIGN), (777, 3 * ALIGN + 5), (5 * ALIGN, 123), (1, 5 * ALIGN + 122)]


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_reads_the_file_bytes(blob, mode):
    path, data = blob
    r = DiskReader(mode)
    f = r.open(path)
    try:
        for off, n in RANGES:
            assert bytes(r.read(f, off, n)) == data[off:off + n], (off, n)
            a, b = bytearray(n // 3), bytearray(n - n // 3)
            r.read_into(f, off, [memoryview(a), memoryview(b)])
            assert bytes(a + b) == data[off:off + n], (off, n)
        assert f.bytes_read == 2 * sum(n for _, n in RANGES)
    finally:
        r.close(f)


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_short_read_past_the_end(blob, mode):
    path, data = blob
    r = DiskReader(mode)
    f = r.open(path)
    with pytest.raises(ShortRead, match="ends before byte"):
        r.read(f, len(data) - 10, 11)
    with pytest.raises(ShortRead):
        r.read_into(f, len(data) - 5, [memoryview(bytearray(20))])
    r.close(f)


def test_direct_refused_at_open_reads_buffered(blob, monkeypatch):
    path, data = blob
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(p, flags, *a)

    monkeypatch.setattr(reader_mod.os, "open", no_direct)
    r = DiskReader("direct")
    f = r.open(path)
    assert f.direct_fd is None
    assert bytes(r.read(f, 100, 5000)) == data[100:5100]
    r.close(f)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_direct_refused_at_read_reads_buffered(blob, monkeypatch):
    path, data = blob
    r = DiskReader("direct")
    f = r.open(path)
    direct_fd, real = f.direct_fd, os.preadv
    assert direct_fd is not None

    def einval(fd, bufs, off):
        if fd == direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)

    monkeypatch.setattr(reader_mod.os, "preadv", einval)
    assert bytes(r.read(f, 9, 3 * ALIGN)) == data[9:9 + 3 * ALIGN]
    assert f.direct_fd is None  # buffered from now on
    r.close(f)


def test_scratch_is_per_thread():
    r = DiskReader("direct")
    bufs = []

    def grab():
        bufs.append(r._scratch(ALIGN * 3))

    threads = [threading.Thread(target=grab) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert bufs[0] is not bufs[1] and len(bufs[0]) >= 3 * ALIGN


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown read mode"):
        DiskReader("mmap")

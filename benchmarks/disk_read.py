"""Read bandwidth of expert-sized reads from disk: O_DIRECT vs buffered + fadvise(DONTNEED) (issue 29).

    python benchmarks/disk_read.py [--dir /tmp] [--file-gb 2] [--read-mb 17] [--reads 100] [--threads 1,4]

Writes a scratch file of random bytes (fsynced, its pages dropped from the page cache), reads
`--reads` ranges of `--read-mb` at random offsets not aligned to 4096 (as safetensors tensors lie)
through `seqmoe.disk.reader.DiskReader` in each mode and thread count, prints MB/s and per-read
latency (p50, p90), then one JSON line; the scratch file is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from seqmoe.disk.reader import MODES, DiskReader


def write_scratch(folder: str, nbytes: int) -> str:
    """A file of `nbytes` random bytes in `folder`, on disk and out of the page cache."""
    fd, path = tempfile.mkstemp(prefix="seqmoe_disk_read_", dir=folder)
    chunk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[:min(left, len(chunk))])
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def measure(path: str, mode: str, offsets: np.ndarray, nbytes: int, threads: int) -> dict:
    """Bandwidth and per-read latency of reading `nbytes` at each offset with `threads` threads."""
    drop_cache(path)
    reader = DiskReader(mode)
    f = reader.open(path)
    out = [bytearray(nbytes) for _ in range(threads)]
    lat = np.zeros(len(offsets))

    def one(i: int) -> None:
        t = time.perf_counter()
        reader.read_into(f, int(offsets[i]), [memoryview(out[i % threads])])
        lat[i] = time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(offsets))))
    wall = time.perf_counter() - t0
    direct = f.direct_fd is not None
    reader.close(f)
    return dict(mode=mode, o_direct_used=direct, threads=threads, reads=len(offsets), read_mb=nbytes / 1e6,
                mb_per_s=len(offsets) * nbytes / wall / 1e6, p50_ms=float(np.percentile(lat, 50) * 1e3),
                p90_ms=float(np.percentile(lat, 90) * 1e3))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the scratch file (on the disk to test)")
    p.add_argument("--file-gb", type=float, default=2.0, help="scratch file size in GB")
    p.add_argument("--read-mb", type=float, default=17.0, help="bytes per read in MB (one expert)")
    p.add_argument("--reads", type=int, default=100, help="reads per mode and thread count")
    p.add_argument("--threads", default="1,4", help="comma-separated reader thread counts")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds of every mode")
    args = p.parse_args()
    size, nbytes = int(args.file_gb * 1e9), int(args.read_mb * 1e6)
    if nbytes >= size:
        p.error("--read-mb must be below --file-gb")
    path = write_scratch(args.dir, size)
    rows = []
    try:
        rng = np.random.default_rng(1)
        for _ in range(args.repeats):  # alternate the modes so drift on a shared disk hits both alike
            for threads in map(int, args.threads.split(",")):
                for mode in MODES:
                    offsets = rng.integers(0, size - nbytes, args.reads) // 8 * 8 + 8
                    rows.append(measure(path, mode, offsets, nbytes, threads))
                    r = rows[-1]
                    print(f"{mode:9s} threads {threads}  {r['mb_per_s']:8.0f} MB/s  p50 {r['p50_ms']:7.2f} ms  "
                          f"p90 {r['p90_ms']:7.2f} ms  (O_DIRECT used: {r['o_direct_used']})", flush=True)
    finally:
        os.unlink(path)
    print(json.dumps(dict(benchmark="disk_read", file_gb=args.file_gb, rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

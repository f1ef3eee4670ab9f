"""Read bandwidth of expert-sized reads from disk: O_DIRECT vs buffered + fadvise(DONTNEED) (issue 29).

    python benchmarks/disk_read.py [--dir /tmp] [--file-gb 2] [--read-mb 17] [--reads 100] [--threads 1,4]

Writes a scratch file of random bytes (fsynced, its pages dropped from the page cache), reads
`--reads` ranges of `--read-mb` at random offsets not aligned to 4096 (as safetensors tensors lie)
through `seqmoe.runtime.disk.reader.DiskReader` in each mode and thread count, prints MB/s and per-read
latency (p50, p90), then one JSON line; the scratch file is removed at the end.

`--expert-files` then writes a DeepSeek-V2-Lite-shaped bf16 checkpoint of one MoE layer (H 2048,
I 1408: 17.3 MB per expert, stored per expert as save_pretrained does) of the same size and times
`ExpertFiles.read_into` in each mode into bf16 rows (no conversion) and fp32 rows (converted after
the read), each on its own quarter of the experts.
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
import torch

from seqmoe.arch.layout import ExpertLayout
from seqmoe.runtime.disk.checkpoint import ExpertFiles
from seqmoe.runtime.disk.reader import MODES, DiskReader

H, I = 2048, 1408  # DeepSeek-V2-Lite's hidden and expert intermediate sizes


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


def write_expert_checkpoint(folder: str, nbytes: int) -> tuple[str, int]:
    """A bf16 model.safetensors of one layer's experts (as many as fit in `nbytes`), streamed to disk."""
    import struct

    E = max(2, nbytes // (3 * H * I * 2))
    header, at = {}, 0
    for e in range(E):
        for name, shape in (("down_proj", [H, I]), ("gate_proj", [I, H]), ("up_proj", [I, H])):
            n = shape[0] * shape[1] * 2
            header[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = dict(dtype="BF16", shape=shape,
                                                                           data_offsets=[at, at + n])
            at += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.safetensors")
    chunk = (np.random.default_rng(2).standard_normal(16 << 20, dtype=np.float32).view(np.uint32) >> 16)
    chunk = chunk.astype(np.uint16).tobytes()  # bf16 numbers (no NaN), 32 MB
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        left = at
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    drop_cache(path)
    return path, E


def measure_expert_files(folder: str, nbytes: int, reads: int) -> list[dict]:
    """ExpertFiles.read_into in each mode into bf16 then fp32 rows: MB/s of checkpoint bytes and
    per-expert latency. Each (mode, dtype) reads its own experts: a virtual disk's host may cache
    what an earlier pass read."""
    path, E = write_expert_checkpoint(folder, nbytes)
    combos = [(mode, dtype) for dtype in (torch.bfloat16, torch.float32) for mode in MODES]
    sets = np.array_split(np.random.default_rng(3).permutation(E), len(combos))
    rows = []
    try:
        for (mode, dtype), experts in zip(combos, sets):
            layout = ExpertLayout(("gate_up_proj", "down_proj"), ((2 * I, H), (H, I)), (0, 2 * I * H), 3 * I * H, dtype)
            files = ExpertFiles.open(folder, ["model.layers.0.mlp.experts"], layout, E, mode=mode)
            out = torch.zeros(layout.numel, dtype=dtype)  # touched: no page faults in the timing
            order = experts[:reads]
            lat = np.zeros(len(order))
            t0 = time.perf_counter()
            for i, e in enumerate(order):
                t = time.perf_counter()
                files.read_into(0, int(e), out)
                lat[i] = time.perf_counter() - t
            wall = time.perf_counter() - t0
            rows.append(dict(expert_files=True, mode=mode, row_dtype=str(dtype).removeprefix("torch."),
                             expert_mb=files.expert_nbytes(0, 0) / 1e6, reads=len(order),
                             mb_per_s=files.bytes_read / wall / 1e6, p50_ms=float(np.percentile(lat, 50) * 1e3),
                             p90_ms=float(np.percentile(lat, 90) * 1e3)))
            files.close()
    finally:
        os.unlink(path)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the scratch file (on the disk to test)")
    p.add_argument("--file-gb", type=float, default=2.0, help="scratch file size in GB")
    p.add_argument("--read-mb", type=float, default=17.0, help="bytes per read in MB (one expert)")
    p.add_argument("--reads", type=int, default=100, help="reads per mode and thread count")
    p.add_argument("--threads", default="1,4", help="comma-separated reader thread counts")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds of every mode")
    p.add_argument("--expert-files", action="store_true", help="also time ExpertFiles.read_into (see above)")
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
    if args.expert_files:
        folder = tempfile.mkdtemp(prefix="seqmoe_disk_ckpt_", dir=args.dir)
        try:
            for r in measure_expert_files(folder, size, args.reads):
                rows.append(r)
                print(f"ExpertFiles {r['mode']:9s} -> {r['row_dtype']:8s} {r['mb_per_s']:8.0f} MB/s  "
                      f"p50 {r['p50_ms']:7.2f} ms  p90 {r['p90_ms']:7.2f} ms per {r['expert_mb']:.1f} MB expert "
                      f"({r['reads']} reads)", flush=True)
        finally:
            os.rmdir(folder)
    print(json.dumps(dict(benchmark="disk_read", file_gb=args.file_gb, rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

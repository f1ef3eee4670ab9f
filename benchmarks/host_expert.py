"""What computing one routed expert on the host CPU costs (issue 15, item 1), next to the memory bandwidth.

    python benchmarks/host_expert.py [--archs deepseek-v2-lite,mixtral-8x7b] [--threads 1,2] [--tokens 1,4]

For each published expert shape (`seqmoe.arch.published`: hidden -> intermediate -> hidden, SwiGLU
as the models compute it), dtype (float32, bfloat16) and torch CPU thread count, the median time of
`down(silu(gate(x)) * up(x))` for a batch of tokens, with weights resident in host memory; and the
bandwidth that implies (expert bytes / time) against this machine's measured copy bandwidth (a
1 GiB tensor copy: read + write). At batch 1 an expert's time is its weights' bytes over the
bandwidth the matmul reaches: the figure a hardware profile's host path scales by cited bandwidth.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from seqmoe.arch.published import ARCHS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def expert_dims(arch: str) -> tuple[int, int]:
    cfg = ARCHS[arch].config
    return cfg["hidden_size"], cfg.get("moe_intermediate_size", cfg["intermediate_size"])


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up (first-touch of the weights, thread pool start)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second of a large host tensor copy, counting read and write."""
    a = torch.ones(int(gib * 2**30) // 4)
    b = torch.empty_like(a)
    s = median_s(lambda: b.copy_(a), 5)
    return 2 * a.numel() * 4 / s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default=",".join(ARCHS), help="comma-separated published architectures")
    p.add_argument("--threads", default="1,2", help="comma-separated torch CPU thread counts")
    p.add_argument("--tokens", default="1,4", help="comma-separated token counts per call")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    before = torch.get_num_threads()
    rows = []
    try:
        bw = copy_bandwidth()
        for arch in args.archs.split(","):
            if arch not in ARCHS:
                p.error(f"unknown architecture {arch!r}; choose from: {', '.join(ARCHS)}")
            d, f = expert_dims(arch)
            for dname, dtype in DTYPES.items():
                g = torch.randn(f, d, dtype=dtype)
                u, w = torch.randn(f, d, dtype=dtype), torch.randn(d, f, dtype=dtype)
                nbytes = 3 * d * f * g.element_size()
                for n in map(int, args.tokens.split(",")):
                    x = torch.randn(n, d, dtype=dtype)
                    F = torch.nn.functional
                    for th in map(int, args.threads.split(",")):
                        torch.set_num_threads(th)
                        with torch.no_grad():
                            s = median_s(lambda: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), w), args.repeats)
                        rows.append(dict(arch=arch, dtype=dname, tokens=n, threads=th, expert_bytes=nbytes,
                                         seconds=s, bytes_per_s=nbytes / s))
    finally:
        torch.set_num_threads(before)
    print(f"host copy bandwidth (read + write): {bw / 1e9:.1f} GB/s")
    print(f"{'arch':18s} {'dtype':9s} {'tokens':>6s} {'threads':>7s} {'MB':>7s} {'ms':>8s} {'GB/s':>6s}")
    for r in rows:
        print(f"{r['arch']:18s} {r['dtype']:9s} {r['tokens']:6d} {r['threads']:7d} {r['expert_bytes'] / 1e6:7.1f} "
              f"{1e3 * r['seconds']:8.2f} {r['bytes_per_s'] / 1e9:6.1f}")
    print(json.dumps({"benchmark": "host_expert", "copy_bytes_per_s": bw, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

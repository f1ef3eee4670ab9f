"""bf16 GEMM efficiency of prefill shapes (DeepSeek-V2-Lite), the measurement behind the hardware
presets' `compute_efficiency`: one expert's SwiGLU at m rows, 64 of them back to back (a layer's
experts one after another, captured as one CUDA graph so the GEMMs are timed, not Python), and a
dense projection of P rows. Needs CUDA (about a minute); prints JSON.

Run: python benchmarks/prefill_gemm_eff.py
"""

from __future__ import annotations

import json
import sys

import torch

H, I, E = 2048, 1408, 64
PEAK = 989.4e12  # H100/H200 dense bf16 FLOP/s (datasheet), as in seqmoe.costs.presets


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def main() -> int:
    if not torch.cuda.is_available():
        print("prefill_gemm_eff.py measures GEMMs on a CUDA device; none is available here", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True  # as the measurement was taken
    dev = "cuda"
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "expert": {}, "dense": {}}
    w1 = [torch.randn(2 * I, H, dtype=torch.bfloat16, device=dev) for _ in range(E)]
    w2 = [torch.randn(H, I, dtype=torch.bfloat16, device=dev) for _ in range(E)]
    for m in (16, 32, 64, 128, 192, 256, 512, 1024, 2048):
        x = torch.randn(m, H, dtype=torch.bfloat16, device=dev)

        def layer(x=x):
            for e in range(E):
                gu = x @ w1[e].T
                (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ w2[e].T

        layer()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layer()
        s = timed(g.replay)
        flops = E * 2 * 3 * H * I * m
        out["expert"][m] = {"s": s, "tflops": flops / s / 1e12, "eff": flops / s / PEAK,
                            "bytes_rate": E * 3 * H * I * 2 / s}
    for P, n in ((512, 3072), (2048, 3072), (2048, 10944), (8192, 3072)):
        x = torch.randn(P, H, dtype=torch.bfloat16, device=dev)
        w = torch.randn(n, H, dtype=torch.bfloat16, device=dev)
        s = timed(lambda x=x, w=w: x @ w.T)
        out["dense"][f"{P}x{H}x{n}"] = {"s": s, "tflops": 2 * P * H * n / s / 1e12, "eff": 2 * P * H * n / s / PEAK}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bf16 GEMM efficiency of prefill shapes (DeepSeek-V2-Lite): one expert's SwiGLU at m rows, 64 of them
back to back (a layer's experts computed one after another), and a dense projection of P rows."""
import json, torch
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
dev = "cuda"
H, I, E = 2048, 1408, 64
PEAK = 989.4e12
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "expert": {}, "dense": {}}
w1 = [torch.randn(2 * I, H, dtype=torch.bfloat16, device=dev) for _ in range(E)]
w2 = [torch.randn(H, I, dtype=torch.bfloat16, device=dev) for _ in range(E)]
def timed(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps): fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps
for m in (16, 32, 64, 128, 192, 256, 512, 1024, 2048):
    x = torch.randn(m, H, dtype=torch.bfloat16, device=dev)
    def layer():
        for e in range(E):
            gu = x @ w1[e].T
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            h @ w2[e].T
    layer()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()  # the 256 launches captured once: the GEMMs' time, not Python's
    with torch.cuda.graph(g):
        layer()
    s = timed(g.replay)
    flops = E * 2 * 3 * H * I * m
    out["expert"][m] = {"s": s, "tflops": flops / s / 1e12, "eff": flops / s / PEAK,
                        "bytes_rate": E * 3 * H * I * 2 / s}
for P, n in ((512, 3072), (2048, 3072), (2048, 10944), (8192, 3072)):
    x = torch.randn(P, H, dtype=torch.bfloat16, device=dev); w = torch.randn(n, H, dtype=torch.bfloat16, device=dev)
    s = timed(lambda: x @ w.T)
    out["dense"][f"{P}x{H}x{n}"] = {"s": s, "tflops": 2 * P * H * n / s / 1e12, "eff": 2 * P * H * n / s / PEAK}
print(json.dumps(out, indent=1))

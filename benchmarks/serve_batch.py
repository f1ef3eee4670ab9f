"""Continuous batching in `seqmoe serve` (issue 28): total tokens/s of N concurrent streaming clients
(the official `openai` client) against the same requests sent one at a time, each response's greedy
text against the one-at-a-time text, and the server's resident memory idle, busy and after.

    python benchmarks/serve_batch.py [--clients 8] [--max-tokens 64] [--system seqmoe]

The server is the real command (`python -m seqmoe serve --model seqmoe-tiny ...`) in a subprocess,
on the CPU; memory is its VmRSS from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPTS = ["def parse(", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self", "for i in range(",
           "    return self.", "# Read the file\nwith open(", "def add(a, b):\n", "x = [", "if __name__ ==",
           "try:\n    import", "while True:\n", "@property\ndef "]
REPO = Path(__file__).resolve().parents[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(args) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "seqmoe", "serve", "--model", "seqmoe-tiny", "--residency", str(args.residency),
            "--system", args.system, "--device", "cpu", "--threads", str(args.threads), "--port", "0",
            "--max-batch", str(args.clients), "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stderr:
        print(line.rstrip(), file=sys.stderr)
        m = re.search(r"serving \S+ on (http://\S+)/v1", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--system", default="seqmoe")
    p.add_argument("--residency", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--rounds", type=int, default=2, help="concurrent rounds (memory is read after each)")
    args = p.parse_args()
    import openai

    proc, base = start_server(args)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.clients)]

        def one(prompt: str) -> tuple[str, int]:
            text, n = [], 0
            for c in client.completions.create(model="seqmoe-tiny", prompt=prompt, max_tokens=args.max_tokens,
                                               temperature=0, stream=True, stream_options={"include_usage": True}):
                if c.choices:
                    text.append(c.choices[0].text)
                if c.usage:
                    n = c.usage.completion_tokens
            return "".join(text), n

        one(prompts[0])  # warm-up: compiled kernels, first allocations
        idle = rss_mib(proc.pid)
        t0 = time.perf_counter()
        alone = [one(q) for q in prompts]
        seq_s = time.perf_counter() - t0
        rounds = []
        for _ in range(args.rounds):
            out = [None] * len(prompts)
            peak = [idle]
            threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(prompts[i]))) for i in range(len(prompts))]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak.append(rss_mib(proc.pid))
                time.sleep(0.05)
            took = time.perf_counter() - t0
            time.sleep(1.0)
            rounds.append((took, out, max(peak), rss_mib(proc.pid)))
        after = rounds[-1][3]
    finally:
        proc.terminate()
        proc.wait(30)
    tokens = sum(n for _, n in alone)
    con_s, out, peak, _ = min(rounds, key=lambda r: r[0])
    same = sum(a[0] == b[0] for a, b in zip(alone, out))
    result = {"clients": args.clients, "max_tokens": args.max_tokens, "system": args.system, "residency": args.residency,
              "tokens": tokens, "sequential_tokens_per_s": tokens / seq_s,
              "concurrent_tokens_per_s": sum(n for _, n in out) / con_s,
              "speedup": (sum(n for _, n in out) / con_s) / (tokens / seq_s), "same_text": f"{same}/{len(out)}",
              "rss_idle_mib": idle, "rss_peak_mib": peak, "rss_after_mib": after, "rss_after_over_idle": after / idle - 1,
              "rss_after_each_round_mib": [r[3] for r in rounds]}
    print("| clients | sequential tokens/s | concurrent tokens/s | x | same text | RSS idle / peak / after (MiB) |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.clients} | {result['sequential_tokens_per_s']:.1f} | {result['concurrent_tokens_per_s']:.1f} | "
          f"{result['speedup']:.2f} | {result['same_text']} | {idle:.0f} / {peak:.0f} / {after:.0f} |")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Continuous batching in `seqmoe serve` (issues 28, 40): total tokens/s of N concurrent streaming
clients (the official `openai` client) against the same requests sent one at a time, each
response's greedy text against the one-at-a-time text, and the server's resident memory idle, busy
and after; for each decode path in the same run: the static cache (the default) and `--eager`.

    python benchmarks/serve_batch.py [--clients 8] [--max-tokens 64] [--system seqmoe] [--paths static,eager]

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


def start_server(args, path: str, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "seqmoe", "serve", "--model", "seqmoe-tiny", "--residency", str(args.residency),
            "--system", args.system, "--device", "cpu", "--threads", str(args.threads), "--port", "0",
            "--max-batch", str(args.clients), "--log-level", "warning", *extra] + (["--eager"] if path == "eager" else [])
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
    p.add_argument("--rounds", type=int, default=4, help="concurrent rounds per path, alternating between paths; the "
                   "fastest counts (memory is read after each)")
    p.add_argument("--paths", default="static,eager", help="decode paths to run, in this order (static: the "
                   "default server; eager: --eager)")
    args = p.parse_args()
    results = measure(args, args.paths.split(","))
    print("| path | clients | sequential tokens/s | concurrent tokens/s: best round / all rounds | x | same text | "
          "RSS idle / peak / after (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['path']} | {r['clients']} | {r['sequential_tokens_per_s']:.1f} | {r['concurrent_tokens_per_s']:.1f} / "
              f"{r['concurrent_tokens_per_s_all_rounds']:.1f} | {r['speedup']:.2f} | {r['same_text']} | "
              f"{r['rss_idle_mib']:.0f} / {r['rss_peak_mib']:.0f} / {r['rss_after_mib']:.0f} |")
    out = {"runs": results}
    if len(results) == 2:
        out["concurrent_ratio"] = results[0]["concurrent_tokens_per_s"] / results[1]["concurrent_tokens_per_s"]
        out["concurrent_ratio_all_rounds"] = (results[0]["concurrent_tokens_per_s_all_rounds"]
                                              / results[1]["concurrent_tokens_per_s_all_rounds"])
        out["same_text_across_paths"] = results[0]["texts"] == results[1]["texts"]
    print(json.dumps(out))
    return 0


def measure(args, paths: list[str]) -> list[dict]:
    """One server per path, all up at once and measured in turn (a machine's drift hits them alike):
    each path's requests one at a time, then `rounds` concurrent rounds per path, alternating."""
    import openai

    servers = [start_server(args, path) for path in paths]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.clients)]
    try:
        clients = [openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) for _, base in servers]

        def one(client, prompt: str) -> tuple[str, int]:
            text, n = [], 0
            for c in client.completions.create(model="seqmoe-tiny", prompt=prompt, max_tokens=args.max_tokens,
                                               temperature=0, stream=True, stream_options={"include_usage": True}):
                if c.choices:
                    text.append(c.choices[0].text)
                if c.usage:
                    n = c.usage.completion_tokens
            return "".join(text), n

        idle, alone, seq_s = [], [], []
        for (proc, _), client in zip(servers, clients):
            one(client, prompts[0])  # warm-up: compiled kernels, first allocations
            idle.append(rss_mib(proc.pid))
            t0 = time.perf_counter()
            alone.append([one(client, q) for q in prompts])
            seq_s.append(time.perf_counter() - t0)
        rounds = [[] for _ in paths]
        for _ in range(args.rounds):
            for k, ((proc, _), client) in enumerate(zip(servers, clients)):
                out, peak = [None] * len(prompts), [idle[k]]
                threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(client, prompts[i])))
                           for i in range(len(prompts))]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                while any(t.is_alive() for t in threads):
                    peak.append(rss_mib(proc.pid))
                    time.sleep(0.05)
                took = time.perf_counter() - t0
                time.sleep(1.0)
                rounds[k].append((took, out, max(peak), rss_mib(proc.pid)))
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)
    results = []
    for k, path in enumerate(paths):
        tokens = sum(n for _, n in alone[k])
        con_s, out, peak, _ = min(rounds[k], key=lambda r: r[0])
        same = sum(a[0] == b[0] for a, b in zip(alone[k], out))
        after = rounds[k][-1][3]
        results.append({
            "path": path, "clients": args.clients, "max_tokens": args.max_tokens, "system": args.system,
            "residency": args.residency, "tokens": tokens, "sequential_tokens_per_s": tokens / seq_s[k],
            "concurrent_tokens_per_s": sum(n for _, n in out) / con_s,
            "speedup": (sum(n for _, n in out) / con_s) / (tokens / seq_s[k]), "same_text": f"{same}/{len(out)}",
            "rss_idle_mib": idle[k], "rss_peak_mib": peak, "rss_after_mib": after,
            "rss_after_over_idle": after / idle[k] - 1, "rss_after_each_round_mib": [r[3] for r in rounds[k]],
            "concurrent_tokens_per_s_each_round": [sum(n for _, n in r[1]) / r[0] for r in rounds[k]],
            "concurrent_tokens_per_s_all_rounds": sum(sum(n for _, n in r[1]) for r in rounds[k]) / sum(r[0] for r in rounds[k]),
            "texts": [t for t, _ in out]})
    return results


if __name__ == "__main__":
    sys.exit(main())

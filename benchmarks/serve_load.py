"""A bounded load test of `seqmoe serve` (issue 43): N streaming clients on loopback for S seconds, each
sending one streamed completion after another; p50 / p99 time to first token and inter-token latency,
the answers by status (only 429s may be refused), and the server's resident memory at start and end.

    python benchmarks/serve_load.py [--clients 64] [--seconds 120] [--max-tokens 32] [--max-batch 8]

The server is the real command (`python -m seqmoe serve --model seqmoe-tiny ...`) in a subprocess on the
CPU; clients are threads of this process with the official `openai` client; the loop ends by itself.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from serve_batch import PROMPTS, rss_mib, start_server  # noqa: E402  the same server start as the batch bench


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--queue-limit", type=int, default=32)
    p.add_argument("--system", default="seqmoe")
    p.add_argument("--residency", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    args = p.parse_args()
    import openai

    server_args = argparse.Namespace(residency=args.residency, system=args.system, threads=args.threads,
                                     clients=args.max_batch)
    proc, base = start_server(server_args, "static", extra=["--queue-limit", str(args.queue_limit)])
    try:
        warm = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        warm.completions.create(model="seqmoe-tiny", prompt="def f(", max_tokens=4, temperature=0)
        rss_start = rss_mib(proc.pid)
        ttft, gaps, status = [], [], collections.Counter()
        lock, end = threading.Lock(), time.monotonic() + args.seconds

        def client(i: int) -> None:
            c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
            n = 0
            while time.monotonic() < end:
                t0 = last = time.monotonic()
                first, mine = None, []
                try:
                    for chunk in c.completions.create(model="seqmoe-tiny", prompt=PROMPTS[(i + n) % len(PROMPTS)],
                                                      max_tokens=args.max_tokens, temperature=0.7, seed=i * 1000 + n,
                                                      stream=True):
                        now = time.monotonic()
                        if chunk.choices and chunk.choices[0].text:
                            if first is None:
                                first = now - t0
                            else:
                                mine.append(now - last)
                            last = now
                    code = 200
                except openai.APIStatusError as e:
                    code = e.status_code
                    time.sleep(0.2)  # a refused client waits a moment, as a retrying one would
                except openai.APIConnectionError:
                    code = "connection"
                with lock:
                    status[code] += 1
                    if first is not None:
                        ttft.append(first)
                    gaps.extend(mine)
                n += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.seconds + 120)
        time.sleep(1.0)
        rss_end = rss_mib(proc.pid)
    finally:
        proc.terminate()
        code = proc.wait(60)
    q = lambda xs, p: float(np.percentile(xs, p)) * 1e3 if xs else float("nan")  # noqa: E731
    out = {"clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens, "max_batch": args.max_batch,
           "queue_limit": args.queue_limit, "system": args.system, "status": {str(k): v for k, v in status.items()},
           "ttft_ms_p50": q(ttft, 50), "ttft_ms_p99": q(ttft, 99), "itl_ms_p50": q(gaps, 50), "itl_ms_p99": q(gaps, 99),
           "tokens": len(gaps) + len(ttft), "rss_start_mib": rss_start, "rss_end_mib": rss_end,
           "rss_growth": rss_end / rss_start - 1, "server_exit": code}
    errors = sum(v for k, v in status.items() if k not in (200, 429))
    print("| clients | seconds | completed | 429 | other errors | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
          "RSS start / end (MiB) | growth |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.clients} | {args.seconds:g} | {status[200]} | {status[429]} | {errors} | {out['ttft_ms_p50']:.0f} / "
          f"{out['ttft_ms_p99']:.0f} | {out['itl_ms_p50']:.1f} / {out['itl_ms_p99']:.1f} | {rss_start:.0f} / "
          f"{rss_end:.0f} | {100 * out['rss_growth']:+.1f} % |")
    print(json.dumps(out))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

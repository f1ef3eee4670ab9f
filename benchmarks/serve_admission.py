"""Admission by forecast overlap in `seqmoe serve` (issue 28, item 5): the same mixed workload with
`--admission fifo` and `--admission overlap`, more requests than batch rows, on seqmoe-tiny (CPU).

    python benchmarks/serve_admission.py [--requests 16] [--max-batch 4] [--residency 0.3] [--rounds 3]

Each rule gets a fresh batcher (`serve.load.start_batcher`, the batcher `seqmoe serve` runs; jobs are
submitted to it directly, without HTTP, which would add the same cost to both) over an emulated
link: every expert row that crosses it costs `--copy-us` (the cost model's bandwidth is set to
match), so misses cost time as they would on a device. Per round every request is queued before the
first is admitted (the batcher is held by a call meanwhile); the workload mixes Python code and English
prose prompts of different lengths and completion lengths (greedy). Reported per rule: tokens/s
(completion tokens over the round's wall time; the median round), the pool's hit rate over the
rounds (runtime stats, per activation), each request's wait from submission to admission (mean, max)
and time to first token, the admissions that passed the head over, and whether every request's text
equals FIFO's. A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

CODE = ["def parse(", "import os\n\n\ndef main():\n    for name in os.listdir(", "class Stack:\n    def __init__(self",
        "for i in range(len(items)):\n    if items[i] ==", "# Read the file\nwith open(path) as f:\n    data =",
        "def add(a, b):\n    return", "try:\n    import json\nexcept ImportError:\n", "@property\ndef name(self):\n"]
PROSE = ["The history of the river valley begins", "Once upon a time, in a small village by the sea,",
         "This function returns the number of", "Please note that the results of the survey",
         "In the morning the weather was cold and", "The committee agreed that the proposal",
         "Return a new list containing the items", "We walked along the beach and talked about"]
MAX_TOKENS = [24, 64, 40, 96]


def workload(n: int) -> list[tuple[str, int]]:
    """`n` requests alternating code and prose, each kind's completion lengths cycling `MAX_TOKENS` (so that
    kind and length are independent: a rule that groups kinds must not serve short requests first)."""
    out = []
    for i in range(n):
        prompts = CODE if i % 2 == 0 else PROSE
        out.append((prompts[(i // 2) % len(prompts)], MAX_TOKENS[(i // 2) % len(MAX_TOKENS)]))
    return out


class Bench:
    """One rule's batcher (fresh runtime) and the rounds it ran."""

    def __init__(self, rule: str, args, requests: list[tuple[str, int]]) -> None:
        from seqmoe.config import LoadConfig, OffloadConfig
        from seqmoe.serve.startup import start_batcher

        expert_bytes = 3 * 160 * 80 * 4  # seqmoe-tiny: hidden 160, expert intermediate 80, fp32
        cfg = OffloadConfig(residency=args.residency, system=args.system, device="cpu", emulate_link=True,
                            hardware="h100-pcie5", bandwidth=expert_bytes / (args.copy_us * 1e-6))
        self.served = start_batcher(LoadConfig(model="seqmoe-tiny", threads=args.threads), cfg, max_batch=args.max_batch,
                                  queue_limit=len(requests), admission=rule)
        self.rule, self.requests, self.rounds = rule, requests, []
        self.ids = [self.served.tokenizer(p)["input_ids"] for p, _ in requests]
        self.round()  # warm-up: first allocations, the pool filled
        self.start = self._snapshot()

    def _snapshot(self) -> tuple[dict, dict]:
        batcher = self.served.batcher
        return batcher.call(self.served.runtime.stats).result(), batcher.counts()

    def round(self) -> dict:
        """Every request queued, then admitted by the rule; the round's wall time, texts, waits."""
        from seqmoe.serve.batcher import GenParams, Job

        batcher, requests, ids = self.served.batcher, self.requests, self.ids
        n = len(requests)
        texts, first, admitted, done = [[] for _ in range(n)], [None] * n, [None] * n, threading.Semaphore(0)
        skipped = []

        def emit(i):
            def on(kind, *a):
                if kind == "text":
                    texts[i].append(a[0])
                    first[i] = first[i] or time.perf_counter()
                else:
                    done.release()
            return on

        jobs = [Job(prompt_ids=ids[i], params=GenParams(max_tokens=m), emit=emit(i)) for i, (_, m) in enumerate(requests)]
        pick = batcher.admission.pick

        def timed_pick(waiting, lanes):
            c = pick(waiting, lanes)
            admitted[jobs.index(waiting[c])] = time.perf_counter()
            skipped.append(c > 0)
            return c

        batcher.admission.pick = timed_pick
        gate = threading.Event()
        batcher.call(gate.wait)
        for j in jobs:
            batcher.submit(j)
        t0 = time.perf_counter()
        gate.set()
        for _ in jobs:
            done.acquire()
        wall = time.perf_counter() - t0
        del batcher.admission.pick
        waits = [a - t0 for a in admitted]
        ttft = [f - t0 for f in first if f is not None]
        return {"wall_s": wall, "texts": ["".join(t) for t in texts], "waits": waits, "ttft": ttft,
                "passed_over": sum(skipped)}

    def result(self) -> dict:
        (s0, c0), (s1, c1) = self.start, self._snapshot()
        self.served.close()
        return summary(self.rule, self.rounds, s0, c0, s1, c1)


def summary(rule: str, rounds: list[dict], s0: dict, c0: dict, s1: dict, c1: dict) -> dict:
    """The rounds' metrics from their records and the stats and counts before and after them."""
    n = len(rounds)
    tokens = c1["completion_tokens"] - c0["completion_tokens"]
    acts = s1["activations"] - s0["activations"]
    hits = (s1["ready"] + s1["late"]) - (s0["ready"] + s0["late"])
    per_round = [tokens / n / r["wall_s"] for r in rounds]
    waits = [w for r in rounds for w in r["waits"]]
    ttft = [w for r in rounds for w in r["ttft"]]
    return {"admission": rule, "tokens_per_s": statistics.median(per_round), "tokens_per_s_rounds": per_round,
            "hit_rate": hits / acts if acts else 0.0, "mean_wait_s": statistics.mean(waits), "max_wait_s": max(waits),
            "mean_ttft_s": statistics.mean(ttft), "max_ttft_s": max(ttft),
            "passed_over": sum(r["passed_over"] for r in rounds) / n, "texts": rounds[0]["texts"],
            "same_text_across_rounds": all(r["texts"] == rounds[0]["texts"] for r in rounds)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--residency", type=float, default=0.3)
    p.add_argument("--system", default="on-demand-lru")
    p.add_argument("--copy-us", type=float, default=100.0, help="emulated link: microseconds per expert row crossing it")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--admissions", default="fifo,overlap")
    args = p.parse_args()
    requests = workload(args.requests)
    benches = [Bench(rule, args, requests) for rule in args.admissions.split(",")]
    for _ in range(args.rounds):  # the rules' rounds alternate: drifting load on the machine hits each alike
        for b in benches:
            b.rounds.append(b.round())
    results = [b.result() for b in benches]
    base = results[0]
    print(f"seqmoe-tiny, CPU, {args.requests} requests (code and prose), max batch {args.max_batch}, r = "
          f"{args.residency}, {args.system}, emulated link {args.copy_us:g} us per expert row, {args.rounds} rounds")
    print("| admission | tokens/s (median round) | x first | hit rate | wait mean / max (s) | TTFT mean / max (s) | "
          "head passed over per round | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        same = sum(a == b for a, b in zip(r["texts"], base["texts"]))
        print(f"| {r['admission']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.3f} | "
              f"{r['hit_rate']:.3f} | {r['mean_wait_s']:.2f} / {r['max_wait_s']:.2f} | "
              f"{r['mean_ttft_s']:.2f} / {r['max_ttft_s']:.2f} | {r['passed_over']:.1f} | {same}/{len(r['texts'])} |")
    out = {"requests": args.requests, "max_batch": args.max_batch, "residency": args.residency, "system": args.system,
           "copy_us": args.copy_us, "rounds": args.rounds,
           "results": [{k: v for k, v in r.items() if k != "texts"} | {"same_text_as_first": r["texts"] == base["texts"]}
                       for r in results]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

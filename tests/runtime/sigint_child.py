"""A process that generates until it gets SIGINT, then checks that the runtime serves the next call.

    python -m tests.runtime.sigint_child thread 4      # control mode, rounds

For each round it prints `go`, generates long requests until a KeyboardInterrupt arrives (the
parent sends SIGINT at a random moment), then prints one JSON line: the seconds the next short
generate took, whether its tokens equal the plain model's, and the CPU seconds the process used
while idle for 0.3 s afterwards (a control thread left spinning would show there). Used by
tests/runtime/test_interrupts.py.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import sys
import time

import torch

from seqmoe.runtime import offload
from tests.arch.collect.tiny_models import tiny_model

PROMPT = [1, 17, 42, 5, 88, 23]
LONG = [1, *range(20, 60)]


def greedy(model, prompt, n):
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0)


def main(control: str, rounds: int) -> None:
    torch.set_num_threads(1)
    model = tiny_model("olmoe")
    want = greedy(copy.deepcopy(model), PROMPT, 8)
    rt = offload(model, 0.3, "on-demand-lru", control=control)
    for i in range(rounds):
        faulthandler.dump_traceback_later(40, exit=True)  # a round that hangs shows where, and ends the process
        print("go", flush=True)
        try:
            while True:
                greedy(model, LONG, 150)
        except KeyboardInterrupt:
            pass
        t0 = time.perf_counter()
        got = greedy(model, PROMPT, 8)
        seconds = time.perf_counter() - t0
        c0 = time.process_time()
        time.sleep(0.3)
        idle_cpu = time.process_time() - c0
        print(json.dumps({"round": i, "seconds": seconds, "equal": bool(torch.equal(got, want)),
                          "idle_cpu_s": idle_cpu, "abandoned": rt.stats()["abandoned_tokens"]}), flush=True)
    faulthandler.cancel_dump_traceback_later()
    rt.restore()
    print(json.dumps({"restored": bool(torch.equal(greedy(model, PROMPT, 8), want))}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

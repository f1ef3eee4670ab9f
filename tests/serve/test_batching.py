"""Continuous batching in `seqmoe serve`: concurrent streaming clients decode together, each gets
the text it gets alone, and requests join and leave between steps (cancellation, stops, sampling).
Throughput and memory are measured by benchmarks/serve_batch.py, not here.
Run: pytest tests/serve/test_batching.py -q
"""

from __future__ import annotations

import re
import threading

import pytest

from tests.serve.conftest import MODEL, RESIDENCY, SYSTEM, LiveServer, openai, wait_for
from tests.serve.test_server import PROMPTS, complete, stream_text


@pytest.fixture(scope="module")
def batched():
    server = LiveServer(max_batch=8, threads=1)
    yield server
    server.close()


def _concurrently(fn, args: list) -> list:
    out, threads = [None] * len(args), []
    for i, a in enumerate(args):
        threads.append(threading.Thread(target=lambda i=i, a=a: out.__setitem__(i, fn(a))))
        threads[-1].start()
    for t in threads:
        t.join(120)
    return out


def test_eight_streaming_clients_decode_together_and_each_gets_its_text_alone(batched):
    client = batched.client()
    wait_for(batched.idle, what="an idle server")
    lengths = [12, 20, 7, 16, 24, 9, 18, 14]  # rows leave at different steps, others keep decoding
    alone = [complete(client, p, max_tokens=n, temperature=0) for p, n in zip(PROMPTS, lengths)]
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(batched.stats()["server"]["running"])

    w = threading.Thread(target=watch)
    w.start()
    got = _concurrently(lambda a: stream_text(client, a[0], max_tokens=a[1], temperature=0), list(zip(PROMPTS, lengths)))
    stop.set()
    w.join()
    for (text, finish, usage), (chunks, sfinish, susage) in zip(alone, got):
        assert "".join(chunks) == text and sfinish == finish and susage.completion_tokens == usage.completion_tokens
    assert max(seen) > 1  # they ran together
    s = wait_for(batched.idle, what="the batch to drain")["server"]
    assert s["failed"] == 0 and s["max_batch"] == 8


def test_four_streaming_clients_on_the_static_cache_get_the_text_of_seqmoe_generate(capsys):
    """`seqmoe serve --max-batch 4` on its default path (one static cache, decoded eagerly on the CPU):
    four concurrent streaming clients, each the text `seqmoe generate` prints for its prompt."""
    from seqmoe.cli import main

    prompts, n, want = PROMPTS[:4], 16, []
    for p in prompts:
        assert main(["generate", "--model", MODEL, "--prompt", p, "--max-new-tokens", str(n), "--residency",
                     str(RESIDENCY), "--system", SYSTEM, "--device", "cpu", "--threads", "1", "--no-progress"]) == 0
        out = capsys.readouterr().out
        want.append(out[len(p):re.search(r"\n\n\d+ tokens in ", out).start()])
    server = LiveServer(max_batch=4, threads=1)
    try:
        client = server.client()
        got = _concurrently(lambda p: stream_text(client, p, max_tokens=n, temperature=0), prompts)
        s = wait_for(server.idle, what="the batch to drain")["server"]
    finally:
        server.close()
    assert ["".join(chunks) for chunks, _, _ in got] == want
    assert s["path"] == "static" and s["max_batch"] == 4 and s["completed"] == 4 and s["failed"] == 0


def test_a_request_leaving_mid_batch_and_seeded_sampling_leave_the_others_exact(batched):
    client = batched.client()
    want = [complete(client, p, max_tokens=16, temperature=0.8, seed=7) for p in PROMPTS[:3]]
    greedy = complete(client, PROMPTS[3], max_tokens=16, temperature=0)

    def leaver(_):
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=200, stream=True)
        for n, _chunk in enumerate(stream):
            if n == 3:
                stream.close()  # a disconnect: its row leaves after the current step
                return None
        return None

    jobs = [("s", p) for p in PROMPTS[:3]] + [("g", PROMPTS[3]), ("x", None)]

    def run(job):
        kind, p = job
        if kind == "x":
            return leaver(None)
        if kind == "s":
            return complete(client, p, max_tokens=16, temperature=0.8, seed=7)
        return complete(client, p, max_tokens=16, temperature=0)

    got = _concurrently(run, jobs)
    assert got[:3] == want and got[3] == greedy
    s = wait_for(batched.idle, what="the batch to drain")["server"]
    assert s["cancelled"] >= 1 and s["failed"] == 0


def test_a_failing_decode_step_fails_its_batch_and_the_next_requests_are_served(batched):
    client = batched.client()
    want = [complete(client, p, max_tokens=10, temperature=0) for p in PROMPTS[:2]]
    model = batched.served.batcher.model
    before = wait_for(batched.idle, what="an idle server")["server"]
    calls, both = [], threading.Barrier(2)

    def broken(*args, **kwargs):
        calls.append(kwargs.get("input_ids").shape[0])
        if kwargs.get("input_ids").shape[0] == 2:  # the first step the two decode together
            raise RuntimeError("injected")
        return type(model).forward(model, *args, **kwargs)

    def ask(p):
        both.wait(10)
        try:
            return complete(client, p, max_tokens=10, temperature=0)
        except openai.InternalServerError as e:
            return e.body["message"]

    model.forward = broken
    try:
        got = _concurrently(ask, PROMPTS[:2])
    finally:
        del model.forward
    if 2 not in calls:  # the two never shared a step (the first finished before the second joined)
        pytest.skip("the requests did not overlap on this machine")
    assert all("injected" in g for g in got)
    assert [complete(client, p, max_tokens=10, temperature=0) for p in PROMPTS[:2]] == want
    s = wait_for(batched.idle, what="an idle server")["server"]
    assert s["failed"] - before["failed"] == 2 and s["running"] == 0


@pytest.mark.parametrize("miss", ["copy", "auto"])
def test_the_posted_engine_serves_a_batch(miss):
    """--control thread batches too: the steps post B rows' routing (and, with auto, B rows to the host CPU)."""
    server = LiveServer(max_batch=4, threads=1, control="thread", miss=miss)
    try:
        client = server.client()
        alone = [complete(client, p, max_tokens=12, temperature=0) for p in PROMPTS[:4]]
        got = _concurrently(lambda p: complete(client, p, max_tokens=12, temperature=0), PROMPTS[:4])
        assert got == alone
        s = wait_for(server.idle, what="the batch to drain")["server"]
        assert s["failed"] == 0 and s["max_batch"] == 4
    finally:
        server.close()

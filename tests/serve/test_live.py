"""`seqmoe serve` in other settings, on uvicorn in this process: no chat template, a full queue, a
failing forward, --eager.

Run: pytest tests/serve/test_live.py -q
"""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL, LiveServer, openai, wait_for
from tests.serve.test_server import PROMPTS, complete


@pytest.fixture(scope="module")
def small_queue():
    """seqmoe-tiny as shipped (no chat template) behind a queue of 2."""
    server = LiveServer(queue_limit=2, max_batch=1, threads=1)
    yield server
    server.close()


def test_chat_without_a_template_is_a_clear_400(small_queue):
    client = small_queue.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "no_chat_template" and "--chat-template" in e.value.body["message"]
    assert complete(client, PROMPTS[0], max_tokens=3)[2].completion_tokens == 3


def test_past_the_queue_limit_a_429_and_waiting_clients_that_leave_free_their_place(small_queue):
    client = small_queue.client()
    before = wait_for(small_queue.idle, what="an idle server")["server"]
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=200, stream=True) for p in PROMPTS[:3]]
    wait_for(lambda: (s := small_queue.stats()["server"])["running"] and s["waiting"] == 2, what="a full queue")
    with pytest.raises(openai.RateLimitError) as e:
        complete(client, PROMPTS[3], max_tokens=3)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    for s in streams[::-1]:  # the waiting ones first, then the running one
        s.close()
    after = wait_for(small_queue.idle, what="the queue to empty")["server"]
    assert after["cancelled"] - before["cancelled"] == 3 and after["rejected"] - before["rejected"] == 1
    assert after["completion_tokens"] - before["completion_tokens"] < 200  # the waiting ones never ran
    assert complete(client, PROMPTS[0], max_tokens=3)[2].completion_tokens == 3


def test_a_failing_forward_is_a_500_and_the_next_request_is_served(small_queue):
    client = small_queue.client()
    want = complete(client, PROMPTS[1], max_tokens=8)
    model = small_queue.served.batcher.model
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the prompt and one decode step ran
            raise RuntimeError("injected")
        return type(model).forward(model, *args, **kwargs)

    model.forward = broken
    try:
        with pytest.raises(openai.InternalServerError) as e:
            complete(client, PROMPTS[1], max_tokens=8)
    finally:
        del model.forward
    assert "injected" in e.value.body["message"] and e.value.body["type"] == "server_error"
    assert complete(client, PROMPTS[1], max_tokens=8) == want
    s = wait_for(small_queue.idle, what="an idle server")["server"]
    assert s["failed"] == 1


@pytest.fixture(scope="module")
def eager_server():
    server = LiveServer(eager=True, threads=1)
    yield server
    server.close()


def test_the_static_cache_path_gives_the_eager_paths_text(eager_server, cli_server):
    """The default server (one static cache) and `--eager` (a growing cache) answer alike, greedy and sampled."""
    eager, static = eager_server.client(), cli_server.client()
    for kw in (dict(max_tokens=20), dict(max_tokens=20, stop=["\n"]), dict(max_tokens=12, temperature=0.8, seed=3)):
        assert complete(static, PROMPTS[1], **kw) == complete(eager, PROMPTS[1], **kw)
    assert eager_server.stats()["server"]["path"] == "eager" and cli_server.stats()["server"]["path"] == "static"

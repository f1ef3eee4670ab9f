"""`seqmoe serve` run for others: the API key, /health, /metrics, limits, the drain on SIGTERM, SIGINT,
and requests the schema must refuse (issue 43).

Run: pytest tests/serve/test_production.py -q
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import urllib.error
import urllib.request

import pytest

from tests.serve.conftest import MODEL, CLIServer, openai, post_raw, wait_for

KEY = "sk-test-0123456789"


def _get(base: str, path: str, key: str | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture(scope="module")
def keyed():
    server = CLIServer("--api-key", KEY, "--max-batch", "4")
    yield server
    server.close()


def test_the_key_guards_every_route_but_health(keyed):
    status, body, _ = _get(keyed.base, "/v1/models")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert _get(keyed.base, "/v1/models", "sk-wrong")[0] == 401
    assert _get(keyed.base, "/health")[0] == 200
    client = openai.OpenAI(base_url=keyed.base + "/v1", api_key=KEY, max_retries=0)
    r = client.completions.create(model=MODEL, prompt="def parse(", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_metrics_parse_and_move_with_a_request(keyed):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        status, body, _ = _get(keyed.base, "/metrics", KEY)
        assert status == 200
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for f in text_string_to_metric_families(body.decode()) for s in f.samples}

    before = scrape()
    client = openai.OpenAI(base_url=keyed.base + "/v1", api_key=KEY, max_retries=0)
    client.completions.create(model=MODEL, prompt="import os", max_tokens=6, temperature=0)
    after = scrape()
    ok = 'seqmoe_http_requests_total{"route": "/v1/completions", "status": "200"}'
    assert after[ok] == before.get(ok, 0) + 1
    assert after["seqmoe_completion_tokens{}"] > before["seqmoe_completion_tokens{}"]
    assert after["seqmoe_time_to_first_token_seconds_count{}"] > before["seqmoe_time_to_first_token_seconds_count{}"]
    assert after["seqmoe_inter_token_latency_seconds_count{}"] > before["seqmoe_inter_token_latency_seconds_count{}"]
    assert 0 <= after["seqmoe_hit_rate{}"] <= 1 and "seqmoe_expert_copies{}" in after


def test_a_10_mb_body_is_a_413(cli_server):
    body = json.dumps({"model": MODEL, "prompt": "x" * (10 << 20)}).encode()
    status, err = post_raw(cli_server.base, "/v1/completions", body)
    assert status == 413 and err["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "\ud800\udfff\ud800 x"}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": [True, False]}, "prompt"),
])
def test_requests_the_schema_refuses_are_400s(cli_server, body, param):
    status, err = post_raw(cli_server.base, "/v1/completions", json.dumps({"model": MODEL, **body}).encode())
    assert status == 400 and param in (err["error"]["param"] or "") + err["error"]["message"]


def test_sigterm_drains_running_streams_refuses_new_ones_and_exits_0():
    server = CLIServer("--max-batch", "4", "--drain-timeout", "60")
    client = server.client()
    started, results = threading.Barrier(5), [None] * 4

    def one(i):
        chunks = client.completions.create(model=MODEL, prompt=f"def f{i}(", max_tokens=48, temperature=0, stream=True)
        first = True
        text = []
        for c in chunks:
            if first:
                started.wait(30)
                first = False
            text.append(c.choices[0].text if c.choices else "")
            results[i] = ("".join(text), c.choices[0].finish_reason if c.choices else None)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has its first token
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _get(server.base, "/health")[0] == 503, what="the drain to begin")
    status, err = post_raw(server.base, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode())
    assert status == 503 and err["error"]["code"] == "draining"
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0
    assert all(r is not None and r[1] in ("length", "stop") for r in results), results


def test_sigint_stops_at_once_without_a_traceback():
    server = CLIServer()
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(30) == 130
    wait_for(lambda: any("interrupted" in line for line in server.log), what="the last line")
    assert not any("Traceback" in line for line in server.log), "".join(server.log)


def test_a_stream_left_unread_is_cancelled_after_the_stall_limit():
    """The ASGI app driven directly, its `send` blocking after the first token as a client that reads
    nothing would make it (on loopback the kernel's buffers hide that from a real socket)."""
    from seqmoe.config import LoadConfig, OffloadConfig
    from seqmoe.serve.api import create_app
    from seqmoe.serve.limits import Limits
    from seqmoe.serve.startup import start_batcher

    served = start_batcher(LoadConfig(model=MODEL, threads=1), OffloadConfig(residency=0.3, device="cpu",
                           system="on-demand-lru"), max_batch=1)
    try:
        app = create_app(served.batcher, served.tokenizer, model_name=served.name,
                         context_length=served.context_length, limits=Limits(stall_s=0.3))
        body = json.dumps({"model": MODEL, "prompt": "def parse(", "max_tokens": 200, "temperature": 0,
                           "stream": True}).encode()

        async def run():
            blocked = asyncio.Event()
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                if messages:
                    return messages.pop()
                await asyncio.Event().wait()  # the client never leaves

            async def send(message):
                if message["type"] == "http.response.body" and message.get("body"):
                    blocked.set()
                    await asyncio.Event().wait()  # the client reads nothing more

            scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                     "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 1),
                     "client": ("127.0.0.1", 2), "root_path": ""}
            task = asyncio.create_task(app(scope, receive, send))
            await asyncio.wait_for(blocked.wait(), 30)
            for _ in range(200):
                if served.batcher.counts()["cancelled"] or served.batcher.counts()["completed"]:
                    break
                await asyncio.sleep(0.05)
            # the one row is free: the next request is admitted and answered while the stalled one still hangs
            nxt = json.dumps({"model": MODEL, "prompt": "import os", "max_tokens": 4, "temperature": 0}).encode()
            sent, bodies = [], [{"type": "http.request", "body": nxt, "more_body": False}]

            async def receive_next():
                if bodies:
                    return bodies.pop()
                await asyncio.Event().wait()  # this client stays

            async def send_next(message):
                sent.append(message)

            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(nxt)).encode())]
            await asyncio.wait_for(app({**scope, "headers": headers}, receive_next, send_next), 30)
            task.cancel()
            return sent

        sent = asyncio.run(run())
        c = served.batcher.counts()
        assert c["cancelled"] == 1 and c["completed"] == 1 and c["completion_tokens"] < 200
        assert sent[0]["status"] == 200 and json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["usage"]
    finally:
        served.close()

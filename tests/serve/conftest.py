"""Servers for the `seqmoe serve` tests: the real command in a subprocess, and in-process ones.

`cli_server` (one per session) runs `python -m seqmoe serve --port 0 ...` with seqmoe-tiny and a
test chat template, and reads the port from its "serving ... on http://..." line. `LiveServer`
runs the same app with uvicorn on a thread of the test process (for other settings: no chat
template, a small queue, --eager). Both listen on a free localhost port.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
MODEL = "seqmoe-tiny"
RESIDENCY = 0.3
SYSTEM = "on-demand-lru"
CHAT_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant:\n{% endif %}")
"""A plain chat template (seqmoe-tiny has none; --chat-template gives it this one)."""


def get_json(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.loads(r.read())


def post_raw(base: str, path: str, data: bytes) -> tuple[int, dict]:
    """POST bytes as application/json; (status, JSON body), errors included."""
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(cond, timeout: float = 20.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Server:
    def __init__(self, base: str) -> None:
        self.base = base

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, **kw)

    def stats(self) -> dict:
        return get_json(self.base, "/stats")

    def idle(self) -> dict | None:
        s = self.stats()
        busy = s["server"]["running"] or s["server"]["waiting"] or s["server"]["open_requests"]
        return None if busy else s


class CLIServer(Server):
    """`seqmoe serve` in a subprocess."""

    def __init__(self, *extra: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        argv = [sys.executable, "-m", "seqmoe", "serve", "--model", MODEL, "--residency", str(RESIDENCY), "--system",
                SYSTEM, "--device", "cpu", "--threads", "1", "--port", "0", "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.log: list[str] = []
        found = threading.Event()
        url: list[str] = []

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"serving \S+ on (http://\S+)/v1", line)
                if m and not url:
                    url.append(m.group(1))
                    found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(120):
            self.proc.kill()
            raise AssertionError("seqmoe serve did not start:\n" + "".join(self.log))
        super().__init__(url[0])
        wait_for(lambda: _up(self.base), what="the server to answer")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _up(base: str) -> bool:
    try:
        get_json(base, "/health")
        return True
    except (urllib.error.URLError, ConnectionError):
        return False


class LiveServer(Server):
    """The app on uvicorn in a thread of this process (`start_batcher` kwargs: eager, queue_limit, ...)."""

    def __init__(self, **load) -> None:
        import uvicorn

        from seqmoe.cli.serve import _bind
        from seqmoe.serve.api import create_app
        from seqmoe.config import LoadConfig, OffloadConfig
        from seqmoe.serve.startup import start_batcher

        offload = {k: load.pop(k) for k in ("control", "miss", "train", "predictor") if k in load}
        self.served = s = start_batcher(LoadConfig(model=MODEL, threads=load.pop("threads", None)), OffloadConfig(residency=RESIDENCY, system=SYSTEM,
                                                                             device="cpu", **offload), **load)
        app = create_app(s.batcher, s.tokenizer, model_name=s.name, context_length=s.context_length,
                         temperature=s.temperature, top_p=s.top_p)
        sock = _bind("127.0.0.1", 0)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, what="uvicorn to start")
        super().__init__(f"http://127.0.0.1:{sock.getsockname()[1]}")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.served.close()


@pytest.fixture(scope="session")
def cli_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("serve") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = CLIServer("--chat-template", str(template), "--queue-limit", "16")
    yield server
    server.close()


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from seqmoe.arch import tiny

    return AutoTokenizer.from_pretrained(tiny.model_dir(), local_files_only=True)

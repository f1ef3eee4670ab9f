"""`seqmoe serve --replicas 2`: two replicas on a local Ray Serve answer as one server does, and one
killed mid-run is replaced while the other serves (issue 43).

Run: pytest tests/serve/test_replicas.py -q
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from seqmoe.base.errors import UserError
from seqmoe.config import LoadConfig, OffloadConfig
from tests.serve.conftest import MODEL, CLIServer, openai, wait_for
from tests.serve.test_production import _get

KEY = "sk-replicas-0123"
PROMPTS = ("def parse(", "import os\n", "class Stack:")


def _complete(client, prompt: str) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text


def _who(server) -> int:
    status, body, _ = _get(server.base, "/stats", KEY)
    assert status == 200, body
    return json.loads(body)["pid"]


def _retried(fn, tries: int = 20):
    """fn(), tried again while a request fails at the server (a dead replica's requests do)."""
    for i in range(tries):
        try:
            return fn()
        except (openai.APIStatusError, openai.APIConnectionError):
            if i == tries - 1:
                raise
            time.sleep(0.5)


def test_two_replicas_answer_as_one_server_and_a_killed_one_comes_back(cli_server):
    pytest.importorskip("ray.serve")
    one = cli_server.client()
    expected = {p: _complete(one, p) for p in PROMPTS}
    server = CLIServer("--replicas", "2", "--api-key", KEY)
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)
        assert {p: _complete(client, p) for p in PROMPTS} == expected
        assert _get(server.base, "/v1/models")[0] == 401  # the key holds on every replica
        status, body, _ = _get(server.base, "/metrics", KEY)
        assert status == 200 and b"seqmoe_replica_info{replica=" in body
        seen: set[int] = set()
        wait_for(lambda: seen.add(_who(server)) or len(seen) == 2, timeout=60, what="both replicas to answer")

        victim, survivor = sorted(seen)
        os.kill(victim, signal.SIGKILL)
        for p in PROMPTS * 3:  # the survivor serves; a request that reached the dead one succeeds on retry
            assert _retried(lambda: _complete(client, p)) == expected[p]
        answered: set[int] = set()  # back to two: the survivor and a new replica answer
        wait_for(lambda: answered.add(_retried(lambda: _who(server))) or (survivor in answered and answered - seen),
                 timeout=120, what="a new replica in the dead one's place")
        assert victim not in answered
        new = (answered - seen).pop()
        assert _retried(lambda: _complete(client, PROMPTS[0])) == expected[PROMPTS[0]]

        server.proc.send_signal(signal.SIGTERM)  # the drain: the deployment goes, the command exits 0
        assert server.proc.wait(120) == 0
        for pid in (survivor, new):
            wait_for(lambda: not _alive(pid), timeout=30, what=f"replica {pid} to stop")
    finally:
        server.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_machine_is_split_between_replicas(monkeypatch):
    from seqmoe.serve.replicas import replica_spec

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    load, spec = replica_spec(LoadConfig(model=MODEL), OffloadConfig(residency=0.3, device="cpu"), 2, None)
    assert (spec.cpus, load.threads, spec.gpus) == (2, 1, 0)
    load, spec = replica_spec(LoadConfig(model=MODEL, threads=3), OffloadConfig(residency=0.3, device="cuda"), 4,
                              "ray://head:10001")  # a cluster: its nodes, not this machine, hold the replicas
    assert (spec.cpus, load.threads, spec.gpus) == (3, 3, 1)
    with pytest.raises(UserError, match="5 replicas of 1 cores each do not fit this machine's 4 cores"):
        replica_spec(LoadConfig(model=MODEL), OffloadConfig(residency=0.3, device="cpu"), 5, None)

"""Bad `seqmoe serve` flags end with one line `seqmoe: error: ...` and exit code 2, before any loading.

Run: pytest tests/serve/test_cli_serve.py -q
"""

from __future__ import annotations

import socket

import pytest

from seqmoe.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port must be in"),
    (["--queue-limit", "-1"], "--queue-limit must be >= 0"),
    (["--context-length", "1"], "--context-length must be >= 2"),
    (["--context-length", "100000000"], "past seqmoe-tiny's context of 256 positions"),
    (["--chat-template", "/nonexistent/chat.jinja"], "no chat template file"),
    (["--replicas", "0"], "--replicas must be >= 1"),
])
def test_bad_flags_are_one_line_errors(capsys, flags, message):
    assert main(["serve", "--model", "seqmoe-tiny", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("seqmoe: error: ") and message in err[0]


def test_a_busy_port_is_reported_before_loading(capsys):
    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "seqmoe-tiny", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err

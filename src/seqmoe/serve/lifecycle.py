"""How `seqmoe serve` stops: SIGTERM drains, SIGINT stops at once; neither ends in a traceback.

    server = DrainingServer(uvicorn.Config(app, ...), api=app.state.api, drain_timeout=30)
    server.run(sockets=[sock])
    server.interrupted      # True when SIGINT ended it (the command exits 130)

SIGTERM (what a container runtime sends) stops admitting: new requests get a 503 with
`Retry-After` (`serve.guard`) and `/health` a 503; the running and waiting requests go on until the
batcher is idle or `drain_timeout` seconds have passed, then uvicorn shuts down and the command exits
0. A second SIGTERM, or SIGINT at any time, stops at once. uvicorn re-raises the signal it caught once
it has shut down; this server does not, so the process ends by returning, not by a KeyboardInterrupt.
"""

from __future__ import annotations

import signal
import threading
import time

import uvicorn

STOP_GRACE_S = 1.0
"""Seconds a stop (SIGINT, or a drain's end) leaves open connections before closing them."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, *, api, drain_timeout: float) -> None:
        super().__init__(config)
        self.api, self.drain_timeout = api, drain_timeout
        self.interrupted = False

    def handle_exit(self, sig: int, frame) -> None:  # uvicorn's signal handler
        if sig == signal.SIGTERM and not self.api.draining:
            self.api.draining = True
            threading.Thread(target=self._drain, name="seqmoe-drain", daemon=True).start()
            return
        self.interrupted = self.interrupted or sig == signal.SIGINT
        if self.should_exit:  # a second signal: no more waiting for connections
            self.force_exit = True
        self.config.timeout_graceful_shutdown = STOP_GRACE_S  # open streams get this long to see their end
        self.should_exit = True  # not recorded in _captured_signals: nothing is re-raised

    def _drain(self) -> None:
        end = time.monotonic() + self.drain_timeout
        while time.monotonic() < end:
            c = self.api.batcher.counts()
            if not c["running"] and not c["waiting"] and not self.api.open_requests:
                break
            time.sleep(0.05)
        self.should_exit = True

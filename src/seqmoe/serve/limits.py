"""What one request of `seqmoe serve` may take (no torch, no fastapi: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one request may take (`seqmoe serve --max-body-bytes`, `--stall-timeout`, `--request-timeout`)."""

    max_body: int = 1 << 20
    """bytes of a request body (past it: 413)"""
    stall_s: float = 30.0
    """seconds a streaming client may leave tokens unread before its request is cancelled"""
    request_timeout_s: float | None = None
    """seconds a request may run in all (None: no deadline)"""

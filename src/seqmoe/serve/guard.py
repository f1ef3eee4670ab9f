"""What stands between the network and `seqmoe serve`'s routes: the API key, the body limit, the drain,
and the count of every answer by status (an ASGI middleware around the FastAPI app).

    app = Guard(app, api_key="...", max_body=1 << 20, draining=lambda: False, metrics=ServerMetrics(),
                routes=frozenset({"/v1/completions", ...}))   # answers elsewhere are counted as "other"

Every route but `/health` needs `Authorization: Bearer KEY` when a key is set (compared in constant
time): a 401 otherwise. A body longer than `max_body` bytes is a 413 (by its Content-Length, or
while it is read when it is sent in chunks). While the server drains, new requests get a 503 with
`Retry-After`. Every error is JSON in the OpenAI shape.
"""

from __future__ import annotations

import hmac
import json

from seqmoe.serve.schemas import error_body

OPEN_ROUTES = ("/health",)
"""Routes answered without the key and while draining (load balancers probe them)."""
DISCARD_LIMIT = 64 << 20
"""Body bytes read and dropped before a refusal is sent (past them the connection is closed)."""
RETRY_AFTER_S = 5
"""What a 503 during a drain tells clients to wait before retrying (another replica by then)."""


class Guard:
    """The middleware (see the module docstring); `draining()` says whether the server drains."""

    def __init__(self, app, *, api_key: str | None, max_body: int, draining, metrics, routes: frozenset) -> None:
        self.app, self.max_body, self.draining, self.metrics, self.routes = app, max_body, draining, metrics, routes
        self.key = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"]
        status = {}

        async def counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if route not in OPEN_ROUTES:
                refusal = self._refusal(scope)
                if refusal is None:
                    body = await _read_body(receive, self.max_body)
                    if body is None:
                        refusal = 413, f"the request body is over {self.max_body} bytes", "request_too_large"
                if refusal is not None:
                    await _discard(receive, DISCARD_LIMIT)  # a client still sending would see a reset, not the answer
                    return await _answer(counted, *refusal)
                receive = _replay(body, receive)
            await self.app(scope, receive, counted)
        finally:
            if "code" in status:
                self.metrics.request(route if route in self.routes else "other", status["code"])  # bounded labels

    def _refusal(self, scope) -> tuple | None:
        headers = dict(scope.get("headers") or ())
        if self.key is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.key):
            return 401, "a valid API key is needed: send the header Authorization: Bearer KEY", "invalid_api_key"
        if self.draining():
            return 503, "the server is shutting down and takes no new requests; retry on another replica", \
                "draining", {"retry-after": str(RETRY_AFTER_S)}
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return 413, f"the request body is over {self.max_body} bytes", "request_too_large"
        return None


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body (None once it passes `limit` bytes)."""
    parts, n, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)  # the client left: the app sees the disconnect through `_replay`
        chunk = message.get("body", b"")
        n += len(chunk)
        if n > limit:
            return None
        parts.append(chunk)
        more = message.get("more_body", False)
    return b"".join(parts)


async def _discard(receive, limit: int) -> None:
    """Read what is left of the body, up to `limit` bytes."""
    n = 0
    while n <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        n += len(message.get("body", b""))


def _replay(body: bytes, receive):
    """A receive that gives the body read once, then the client's own messages (a disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _answer(send, status: int, message: str, code: str, headers: dict | None = None) -> None:
    kind = {401: "authentication_error", 503: "server_error"}.get(status, "invalid_request_error")
    payload = json.dumps(error_body(message, type=kind, code=code)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": payload})

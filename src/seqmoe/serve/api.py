"""The HTTP side of `seqmoe serve`: an OpenAI-compatible FastAPI app in front of one `Batcher`.

    app = create_app(batcher, tokenizer, model_name="seqmoe-tiny", context_length=256)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (with
`stream: true` as server-sent events, `stream_options.include_usage` for a last usage chunk) and
`GET /stats` (the runtime's `stats()`, the server's counts, the process's resident memory), `GET /metrics`
(Prometheus' text format, `serve.metrics`) and `GET /health` (200, or 503 while draining). In front of
them `serve.guard`: the API key, the body limit, the drain.
Handlers validate, tokenize, enqueue a `Job` and turn its events into responses; they never touch
the model. Every failure is a JSON error in the OpenAI shape: 400 for a bad body or value, 404 for
an unknown model, 429 when `queue_limit` requests already wait. A client that goes away (mid-stream
or while waiting) cancels its job; so does one that stops reading a stream for `stall_s`, and a
request still running after `request_timeout_s` (its row is free at the next step).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from seqmoe.runtime.proc import status_bytes
from seqmoe.serve.batcher import Batcher, GenParams, Job, QueueFull
from seqmoe.serve.guard import Guard
from seqmoe.serve.limits import Limits
from seqmoe.serve.metrics import CONTENT_TYPE, ServerMetrics
from seqmoe.serve.schemas import APIError, ChatRequest, CompletionRequest, error_body

DEFAULT_COMPLETION_TOKENS = 16
"""max_tokens of a completion that does not say (OpenAI's default); a chat reply may fill the context."""


def create_app(batcher: Batcher, tokenizer, *, model_name: str, context_length: int, temperature: float = 0.0,
               top_p: float = 1.0, api_key: str | None = None, limits: Limits = Limits(),
               replica: str | None = None) -> FastAPI:
    """The app. `tokenizer` is copied (the batcher thread decodes with its own); `temperature` and
    `top_p` are the defaults of requests that do not set them; `api_key`: every route but /health
    needs it (None: open); `replica`: this app's name among Ray Serve's replicas (in /stats and /metrics)."""
    api = _Api(batcher, copy.deepcopy(tokenizer), model_name, context_length, temperature, top_p, limits, replica)
    app = FastAPI(title="seqmoe", description="OpenAI-compatible server for an offloaded MoE model")
    app.state.api = api

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return JSONResponse(_validation_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), type="invalid_request_error"), status_code=exc.status_code)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        api.check_model(name)
        return api.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.complete(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await api.chat(body, request)

    @app.get("/stats")
    async def stats():
        return await api.stats()

    @app.get("/metrics")
    async def metrics():
        return Response(await api.scrape(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health():
        if api.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    app.add_middleware(Guard, api_key=api_key, max_body=limits.max_body, draining=lambda: api.draining,
                       metrics=api.metrics, routes=frozenset(r.path for r in app.routes))
    return app


def _validation_body(exc: RequestValidationError) -> dict:
    err = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return error_body(f"the request body is not valid JSON: {err.get('msg')}", code="invalid_json")
    where = ".".join(loc)
    return error_body(f"{where}: {err.get('msg')}" if where else str(err.get("msg")), param=where or None)


class _Api:
    def __init__(self, batcher: Batcher, tokenizer, model_name: str, context_length: int, temperature: float,
                 top_p: float, limits: Limits, replica: str | None) -> None:
        self.batcher, self.tokenizer, self.name, self.replica = batcher, tokenizer, model_name, replica
        self.context_length, self.temperature, self.top_p, self.limits = context_length, temperature, top_p, limits
        self.metrics = ServerMetrics(replica)
        self.draining = False  # set by a SIGTERM (`serve.lifecycle`): new requests get a 503
        self.created = int(time.time())
        self.open_requests = 0  # completion handlers and streams not yet closed (a leak shows here)

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "seqmoe",
                "max_model_len": self.context_length}

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    # --- requests ------------------------------------------------------------------------------

    async def complete(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        if body.echo or body.best_of not in (None, 1):
            raise APIError(400, "echo and best_of are not supported", param="echo" if body.echo else "best_of")
        ids = self._encode_prompt(body.prompt)
        params = self._params(body, len(ids), body.max_tokens, DEFAULT_COMPLETION_TOKENS)
        return await self._respond(request, ids, params, body, chat=False)

    async def chat(self, body: ChatRequest, request: Request):
        self.check_model(body.model)
        if self.tokenizer.chat_template is None:
            raise APIError(400, f"{self.name} has no chat template, so its messages cannot be formatted; use "
                           "/v1/completions, or start the server with --chat-template FILE (a Jinja template)",
                           param="messages", code="no_chat_template")
        if not body.messages:
            raise APIError(400, "messages is empty", param="messages")
        ids = self._encode_chat(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._params(body, len(ids), max_tokens, None)
        return await self._respond(request, ids, params, body, chat=True)

    def _encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            vocab = len(self.tokenizer)
            if any(x < 0 or x >= vocab for x in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request (batch 1); got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        ids = self.tokenizer(_utf8(prompt, "prompt"))["input_ids"]  # as `seqmoe generate` encodes --prompt
        if not ids:
            raise APIError(400, "the prompt has no tokens", param="prompt")
        return ids

    def _encode_chat(self, body: ChatRequest) -> list[int]:
        messages = []
        for m in body.messages:
            content = m.content
            if isinstance(content, list):  # content parts: only text ones
                if any(p.get("type") != "text" for p in content):
                    raise APIError(400, "only text content parts are supported", param="messages")
                content = "".join(str(p.get("text", "")) for p in content)
            messages.append({**m.model_dump(exclude_none=True), "role": m.role,
                             "content": _utf8(content or "", "messages")})
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception() or a Jinja error
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise APIError(400, "the formatted messages have no tokens", param="messages")
        return ids

    def _params(self, body, n: int, max_tokens: int | None, default_max: int | None) -> GenParams:
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1 (the batcher decodes one sequence per request), got {body.n}", param="n")
        if body.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        ctx = self.context_length
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if n >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens, and the prompt has {n} tokens, "
                           "leaving no room for a completion; shorten the prompt", param="prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = ctx - n if default_max is None else min(default_max, ctx - n)
        elif n + max_tokens > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens, but you requested {n + max_tokens} "
                           f"tokens ({n} in the prompt, {max_tokens} for the completion); lower max_tokens to at most "
                           f"{ctx - n} or shorten the prompt", param="max_tokens", code="context_length_exceeded")
        temperature = self.temperature if body.temperature is None else body.temperature
        if not 0 <= temperature <= 2:
            raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
        top_p = self.top_p if body.top_p is None else body.top_p
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
        if body.seed is not None and not -(1 << 63) <= body.seed < (1 << 64):
            raise APIError(400, f"seed must be a 64-bit integer, in [-2**63, 2**64), got {body.seed}", param="seed")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        if len(stop) > 4 or any(not s for s in stop):
            raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
        return GenParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=body.seed, stop=tuple(stop))

    # --- responses -----------------------------------------------------------------------------

    async def _respond(self, request: Request, ids: list[int], params: GenParams, body, *, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(*event) -> None:  # called on the batcher thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (server shutting down)
                pass

        timed = self._timed(emit)
        job = Job(prompt_ids=ids, params=params, emit=timed)
        try:
            self.batcher.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                           code="queue_full") from None
        self.open_requests += 1
        state = {"ended": False, "closed": False, "read": time.monotonic()}

        def close() -> None:  # once per request, however it ends: cancel the job unless it ended
            if not state["closed"]:
                state["closed"] = True
                self.open_requests -= 1
                if not state["ended"]:
                    self.batcher.cancel(job)

        reply = _Reply(self.name, chat)
        watchdog = asyncio.create_task(self._watchdog(job, events, state, stream=body.stream))
        state["watchdog"] = watchdog
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            # `background` also runs when the client left before the stream started (the generator
            # then never runs, nor its finally).
            return StreamingResponse(self._stream(events, reply, usage, state, close), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(close))
        watch = asyncio.create_task(self._watch_disconnect(request, events))
        parts = []
        try:
            while True:
                event = await events.get()
                if event[0] == "text":
                    parts.append(event[1])
                    continue
                state["ended"] = event[0] != "gone"
                if event[0] == "done":
                    return reply.full("".join(parts), event[1], event[2])
                if event[0] == "gone":
                    raise APIError(400, "the client disconnected", code="client_disconnected")
                if event[0] == "timeout":
                    raise APIError(504, event[1], type="server_error", code="request_timeout")
                raise APIError(500, event[1], type="server_error")
        finally:
            watch.cancel()
            watchdog.cancel()
            close()

    @staticmethod
    async def _watch_disconnect(request: Request, events: asyncio.Queue) -> None:
        """Wake the (non-streamed) handler with a "gone" event when its client goes away."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        events.put_nowait(("gone",))

    async def _stream(self, events: asyncio.Queue, reply: "_Reply", usage: bool, state: dict, close):
        try:
            if reply.chat:
                yield _sse(reply.chunk({"role": "assistant", "content": ""}))
            while True:
                event = await events.get()
                state["read"] = time.monotonic()
                if event[0] == "text":
                    yield _sse(reply.chunk(event[1]))
                    continue
                state["ended"] = event[0] != "timeout"
                if event[0] == "done":
                    yield _sse(reply.chunk(None, finish=event[1]))
                    if usage:
                        yield _sse(reply.usage_chunk(event[2]))
                else:
                    yield _sse(error_body(event[1], type="server_error"))
                yield "data: [DONE]\n\n"
                return
        finally:  # the reply ended, or the client went away (Starlette cancels this generator)
            state["watchdog"].cancel()
            close()

    def _timed(self, emit):
        """`emit` that also times the first token and the gaps between tokens (on the batcher thread)."""
        last = [time.monotonic()]

        def timed(*event) -> None:
            if event[0] == "text":
                now = time.monotonic()
                (self.metrics.token_gap if len(last) > 1 else self.metrics.first_token)(now - last[-1])
                last[:] = [last[0], now]
            emit(*event)

        return timed

    async def _watchdog(self, job: Job, events: asyncio.Queue, state: dict, *, stream: bool) -> None:
        """Cancel `job` once it runs past the deadline, or (streamed) once its client has left tokens
        unread for the stall limit: its row is free at the batcher's next step."""
        lim, start = self.limits, time.monotonic()
        tick = min(1.0, lim.stall_s / 4, (lim.request_timeout_s or 1.0) / 4)
        while not state["closed"]:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if lim.request_timeout_s is not None and now - start > lim.request_timeout_s:
                self.batcher.cancel(job)
                events.put_nowait(("timeout", f"the request ran past the server's limit of {lim.request_timeout_s:g} s "
                                   "(--request-timeout)"))
                return
            if stream and not events.empty() and now - state["read"] > lim.stall_s:
                self.batcher.cancel(job)  # the client reads nothing: its row goes to the next request
                return

    async def scrape(self) -> bytes:
        runtime = self.batcher.runtime
        rt = await asyncio.wrap_future(self.batcher.call(runtime.stats)) if runtime is not None else None
        return self.metrics.render(self.batcher.counts(), rt)

    async def stats(self) -> dict:
        runtime = self.batcher.runtime
        rt = await asyncio.wrap_future(self.batcher.call(runtime.stats)) if runtime is not None else None
        server = {**self.batcher.counts(), "open_requests": self.open_requests}
        return {"model": self.name, "server": server, "runtime": rt, "rss_bytes": rss_bytes(), "pid": os.getpid(),
                "replica": self.replica}


def _utf8(text: str, param: str) -> str:
    """`text` when it is valid Unicode text (JSON lets a lone surrogate through, which no tokenizer reads)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid text: {e.reason} at position {e.start}", param=param) from None
    return text


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Reply:
    """The JSON of one reply, completion or chat, whole or in chunks."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, delta, finish: str | None = None) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux /proc), or None where there is no /proc."""
    return status_bytes("VmRSS")

"""Request bodies of the OpenAI-compatible endpoints and the OpenAI error shape.

Fields the batcher cannot honour are rejected with a 400 (`n` other than 1, `logprobs`, `echo`,
`best_of`); other unknown fields are ignored, as OpenAI-compatible servers do. Values are checked
in `seqmoe.serve.api` so the messages can say what to send instead.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt


class APIError(Exception):
    """A request the server answers with an OpenAI-shaped JSON error (see `body`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}, what the OpenAI API returns (and its client reads)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt]
    echo: StrictBool = False
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed on to the chat template

    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None

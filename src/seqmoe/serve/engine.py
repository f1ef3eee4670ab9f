"""One engine thread that owns an offloaded model and decodes one request at a time, FIFO.

    engine = Engine(runtime, tokenizer, queue_limit=32)       # starts its thread
    job = Job(prompt_ids=[...], params=GenParams(max_tokens=32), emit=callback)
    engine.submit(job)                                        # QueueFull past queue_limit waiting jobs
    engine.cancel(job)                                        # a waiting job leaves the queue; a running one stops after its token
    engine.call(fn).result()                                  # fn() on the engine thread, between two tokens
    engine.close()

The runtime is batch 1 and torch is not re-entrant, so every forward (and `runtime.stats()`)
runs on this thread; HTTP handlers only enqueue jobs and receive events through `emit`, which
the engine calls from its thread: ("text", delta), then ("done", finish_reason, usage) or
("error", message). A cancelled job gets no more events. Cancelling never interrupts a forward:
the decode loop looks at the job's flag after each token, so the runtime's state stays
consistent and the next job starts at once.
"""

from __future__ import annotations

import collections
import inspect
import secrets
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from seqmoe.serve.sampling import TextStream, choose_token


class QueueFull(Exception):
    """The engine already has `queue_limit` jobs waiting."""


@dataclass(frozen=True, kw_only=True)
class GenParams:
    """How one request decodes."""

    max_tokens: int
    """new tokens at most (>= 1)"""
    temperature: float = 0.0
    """0: greedy (argmax, the tokens of `seqmoe generate`); > 0: sample from softmax(logits / temperature)"""
    top_p: float = 1.0
    """nucleus sampling mass (1: off)"""
    seed: int | None = None
    """seed of the request's own torch.Generator (None: a random one)"""
    stop: tuple[str, ...] = ()
    """stop sequences: the text ends before the first one and decoding stops"""


@dataclass(eq=False, kw_only=True)
class Job:
    """One request: its prompt token ids, its parameters and where its events go."""

    prompt_ids: list[int]
    params: GenParams
    emit: Callable[..., None]
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class ServerCounts:
    """What the engine has served (read through `Engine.counts()`)."""

    received: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    forward_positions: int = 0  # positions the model ran: prompt + completion - 1 per request
    decode_s: float = 0.0        # wall seconds in jobs (prompt included)


class Engine:
    """The decode thread of `seqmoe serve` (see the module docstring).

    Args:
        runtime: an `OffloadRuntime` (or None with `model` given: the model served fully loaded).
        tokenizer: the model's tokenizer (decodes the generated text).
        queue_limit: jobs that may wait behind the running one; `submit` raises QueueFull past it.
        eos_token_ids: generation ends after any of these (default: the model's generation config's,
            else the tokenizer's).
        graph: a `seqmoe.runtime.DecodeGraph` that decodes greedy jobs (None: the eager loop); it
            stops at one end-of-sequence id only (the smallest).
        model: the model to serve when `runtime` is None.
    """

    def __init__(self, runtime, tokenizer, *, queue_limit: int = 32, eos_token_ids: tuple[int, ...] | None = None,
                 graph=None, model=None) -> None:
        self.runtime, self.tokenizer, self.graph = runtime, tokenizer, graph
        self.model = runtime.model if runtime is not None else model
        self.device = next(self.model.parameters()).device
        self.queue_limit = queue_limit
        self.eos = set(eos_token_ids if eos_token_ids is not None else _eos_ids(self.model, tokenizer))
        # transformers >= 5.2x names the forward's cache `cache` (`past_key_values` is deprecated)
        forward = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        # generate() computes only the last position's logits in the prompt pass; so do we (same numbers)
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self.counts_ = ServerCounts()
        self.running: Job | None = None
        self._jobs: collections.deque[Job] = collections.deque()
        self._calls: collections.deque[tuple[Callable, Future]] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="seqmoe-engine", daemon=True)
        self._thread.start()

    # --- called from other threads -------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise RuntimeError("the engine is closed")
            # jobs that would wait behind a running one once this one is in (an idle engine starts one at once)
            if len(self._jobs) + 1 - (self.running is None) > self.queue_limit:
                self.counts_.rejected += 1
                raise QueueFull(f"{len(self._jobs)} requests are already waiting (queue limit {self.queue_limit})")
            self.counts_.received += 1
            self._jobs.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Drop a waiting job, or stop a running one after its current token; no more events for it."""
        with self._cv:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            if job in self._jobs:
                self._jobs.remove(job)
                self.counts_.cancelled += 1

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the engine thread (between two tokens, or at once when idle); its future."""
        fut: Future = Future()
        with self._cv:
            if self._closing:
                raise RuntimeError("the engine is closed")
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def counts(self) -> dict:
        with self._cv:
            c = dict(vars(self.counts_))
            c.update(waiting=len(self._jobs), running=self.running is not None, queue_limit=self.queue_limit,
                     wall_tokens_per_s=c["completion_tokens"] / c["decode_s"] if c["decode_s"] else 0.0)
        return c

    def close(self) -> None:
        """Cancel what waits, finish the running token, stop the thread."""
        with self._cv:
            self._closing = True
            for job in self._jobs:
                job.cancelled.set()
            self._jobs.clear()
            if self.running is not None:
                self.running.cancelled.set()
            self._cv.notify()
        self._thread.join()

    # --- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._calls and not self._closing:
                    self._cv.wait()
                if self._closing and not self._calls:
                    return
                job = self._jobs.popleft() if self._jobs else None
                self.running = job
            self._run_calls()
            if job is not None:
                self._run(job)

    def _run_calls(self) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    return
                fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _run(self, job: Job) -> None:
        t0 = time.perf_counter()
        stats = _JobCounts()
        try:
            with torch.no_grad():
                finish = self._decode(job, stats)
        except Exception as e:  # noqa: BLE001 - one failed request must not stop the server
            traceback.print_exc()
            outcome, event = "failed", ("error", f"generation failed: {type(e).__name__}: {e}")
        else:
            if finish is None:
                outcome, event = "cancelled", None
            else:
                outcome = "completed"
                n = len(job.prompt_ids)
                event = ("done", finish, {"prompt_tokens": n, "completion_tokens": stats.completion,
                                          "total_tokens": n + stats.completion})
        with self._cv:
            c = self.counts_
            setattr(c, outcome, getattr(c, outcome) + 1)
            c.prompt_tokens += len(job.prompt_ids) if stats.positions else 0
            c.completion_tokens += stats.completion
            c.forward_positions += stats.positions
            c.decode_s += time.perf_counter() - t0
            self.running = None
        if event is not None and not job.cancelled.is_set():
            job.emit(*event)

    def _decode(self, job: Job, stats: "_JobCounts") -> str | None:
        """Decode `job`, emitting text; its finish reason ("stop" or "length"), None if cancelled."""
        p = job.params
        if job.cancelled.is_set():
            return None
        if self.graph is not None and p.temperature <= 0:
            return self._decode_graph(job, stats)
        gen = torch.Generator(device=self.device).manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        text = TextStream(self.tokenizer, p.stop)
        from transformers import DynamicCache

        # As model.generate builds it; the runtime's hooks see an empty cache as a new request.
        kv = {self._cache_kwarg: DynamicCache(config=self.model.config.get_text_config(decoder=True))}
        ids = torch.tensor([job.prompt_ids], device=self.device)
        finish = "length"
        for i in range(p.max_tokens):
            logits = self.model(input_ids=ids, use_cache=True, **kv, **self._keep).logits
            stats.positions += ids.shape[1]
            token = choose_token(logits[0, -1], temperature=p.temperature, top_p=p.top_p, generator=gen)
            stats.completion += 1
            if token in self.eos:
                finish = "stop"
                break
            delta = text.push(token)
            if delta:
                job.emit("text", delta)
            if text.finished:
                return "stop"
            if i == p.max_tokens - 1:
                break
            if job.cancelled.is_set():
                return None
            self._run_calls()
            ids = torch.tensor([[token]], device=self.device)
        self._flush(job, text)
        return finish

    def _decode_graph(self, job: Job, stats: "_JobCounts") -> str:
        """A greedy job through DecodeGraph: the whole completion at once, then its text."""
        p, n = job.params, len(job.prompt_ids)
        ids = torch.tensor([job.prompt_ids], device=self.device)
        eos = min(self.eos) if self.eos else None
        steps = self.graph.steps
        out = self.graph.generate(ids, p.max_tokens, eos_token_id=eos)[0, n:].tolist()
        stats.positions += n + self.graph.steps - steps  # the prompt, then each decode step it ran
        text = TextStream(self.tokenizer, p.stop)
        for token in out:  # usage counts what the eager loop would have generated (up to the stop)
            stats.completion += 1
            if token in self.eos:
                break
            text.push(token)
            if text.finished:
                break
        if text.text:
            job.emit("text", text.text)
        return "stop" if text.finished or (out and out[-1] in self.eos) else "length"

    @staticmethod
    def _flush(job: Job, text: TextStream) -> None:
        rest = text.flush()
        if rest:
            job.emit("text", rest)


@dataclass
class _JobCounts:
    completion: int = 0
    positions: int = 0


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

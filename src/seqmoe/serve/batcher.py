"""One batcher thread that owns an offloaded model and decodes its requests in a running batch.

    batcher = Batcher(runtime, tokenizer, queue_limit=32, max_batch=8)   # starts its thread
    job = Job(prompt_ids=[...], params=GenParams(max_tokens=32), emit=callback)
    batcher.submit(job)                                        # QueueFull past queue_limit waiting jobs
    batcher.cancel(job)                                        # a waiting job leaves the queue; a running one stops after its token
    batcher.call(fn).result()                                  # fn() on the batcher thread, between two steps
    batcher.close()

Continuous batching: between two decode steps, waiting jobs join the running batch (up to `max_batch`
rows; which job first: `serve.admission`, FIFO by default) by a prompt forward of their own, and finished
or cancelled ones leave; each decode step is one forward over every running row, each row on its own
lane of the runtime (`OffloadRuntime.use_lanes`), so each sequence keeps its forecaster state. The
rows live in one static cache (`serve.static.StaticBatch`, one CUDA graph per row count on a GPU), or
with `static=None` in a growing left-padded cache (`serve.kv.BatchKV`, the eager path). torch is not
re-entrant, so every forward (and `runtime.stats()`) runs on this thread; HTTP handlers only enqueue
jobs and receive events through `emit`, which the batcher calls from its thread: ("text", delta),
then ("done", finish_reason, usage) or ("error", message). A cancelled job gets no more events.
Cancelling never interrupts a forward: the batcher looks at the jobs' flags after each step, so the
runtime's state stays consistent.
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

from seqmoe.serve.admission import Admission
from seqmoe.base.heap import trim
from seqmoe.serve.kv import BatchKV, why_one_at_a_time
from seqmoe.serve.sampling import TextStream, choose_token
from seqmoe.serve.static import StaticBatch


class QueueFull(Exception):
    """The batcher already has `queue_limit` jobs waiting."""


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
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class ServerCounts:
    """What the batcher has served (read through `Batcher.counts()`)."""

    received: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    forward_positions: int = 0  # positions the model ran: prompt + completion - 1 per request
    busy_s: float = 0.0          # wall seconds with jobs running or waiting


class Batcher:
    """The decode thread of `seqmoe serve` (see the module docstring).

    Args:
        runtime: an `OffloadRuntime` (or None with `model` given: the model served fully loaded).
        tokenizer: the model's tokenizer (decodes the generated text).
        queue_limit: jobs that may wait beside the running batch; `submit` raises QueueFull past it.
        max_batch: rows decoded together at most (1: one request at a time). Lowered to 1, with the
            reason in `batch_note`, where the model's cache serves one sequence (sliding-window layers).
        eos_token_ids: generation ends after any of these (default: the model's generation config's,
            else the tokenizer's).
        static: the static cache's positions (the context length), or None: the eager path.
        capture: capture the static path's steps as CUDA graphs (default: on CUDA with thread control).
        model: the model to serve when `runtime` is None.
        admission: which waiting job takes a free row (`serve.admission.ADMISSIONS`; default FIFO).
    """

    def __init__(self, runtime, tokenizer, *, queue_limit: int = 32, max_batch: int = 1,
                 eos_token_ids: tuple[int, ...] | None = None, static: int | None = None, capture: bool | None = None,
                 model=None, admission: str = "fifo") -> None:
        self.runtime, self.tokenizer = runtime, tokenizer
        self.model = runtime.model if runtime is not None else model
        self.device = next(self.model.parameters()).device
        self.queue_limit = queue_limit
        self.eos = set(eos_token_ids if eos_token_ids is not None else _eos_ids(self.model, tokenizer))
        # transformers >= 5.2x names the forward's cache `cache` (`past_key_values` is deprecated)
        forward = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        # generate() computes only the last position's logits in the prompt pass; so do we (same numbers)
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self.batch_note = why_one_at_a_time(self._new_cache())
        self.max_batch = 1 if self.batch_note else max_batch
        self.admission = Admission(admission, self.model, runtime, self.max_batch)
        self.counts_ = ServerCounts()
        self._rows: list[_Row] = []  # the running batch, in the order of its cache's rows
        self._kv: BatchKV | StaticBatch | None = None if static is None or self.batch_note else StaticBatch(
            self.model, self.max_batch, static, self._cache_kwarg, runtime, capture)
        self.path = "eager" if self._kv is None else "captured" if self._kv.capture else "static"
        self._jobs: collections.deque[Job] = collections.deque()
        self._calls: collections.deque[tuple[Callable, Future]] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="seqmoe-batcher", daemon=True)
        self._thread.start()

    # --- called from other threads -------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise RuntimeError("the batcher is closed")
            # jobs that would wait once this one is in (free rows of the batch take jobs at once)
            if len(self._jobs) + 1 - max(0, self.max_batch - len(self._rows)) > self.queue_limit:
                self.counts_.rejected += 1
                raise QueueFull(f"{len(self._jobs)} requests are already waiting (queue limit {self.queue_limit})")
            self.counts_.received += 1
            self._jobs.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Drop a waiting job, or stop a running one after its current step; no more events for it."""
        with self._cv:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            if job in self._jobs:
                self._jobs.remove(job)
                self.counts_.cancelled += 1

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the batcher thread (between two steps, or at once when idle); its future."""
        fut: Future = Future()
        with self._cv:
            if self._closing:
                raise RuntimeError("the batcher is closed")
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def counts(self) -> dict:
        with self._cv:
            c = dict(vars(self.counts_))
            c.update(waiting=len(self._jobs), running=len(self._rows), max_batch=self.max_batch, path=self.path,
                     queue_limit=self.queue_limit, **self.admission.counts(),
                     wall_tokens_per_s=c["completion_tokens"] / c["busy_s"] if c["busy_s"] else 0.0)
        return c

    def alive(self) -> bool:
        """Whether the batcher thread still runs (it ends at `close`, or with an error of its own)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Cancel what waits, finish the running step, stop the thread."""
        with self._cv:
            self._closing = True
            for job in self._jobs:
                job.cancelled.set()
            self._jobs.clear()
            for row in self._rows:
                row.job.cancelled.set()
            self._cv.notify()
        self._thread.join()
        self.admission.close()

    # --- the batcher thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._calls and not self._rows and not self._closing:
                    self._cv.wait()
                if self._closing and not self._calls and not self._rows:
                    return
                t0, busy = time.perf_counter(), bool(self._jobs or self._rows)
            self._run_calls()
            self._admit()
            if self._rows:
                self._guarded(self._step)
            if busy and not self._rows:
                trim()  # the batch drained: its KV caches and activations go back to the OS
            if busy:
                with self._cv:
                    self.counts_.busy_s += time.perf_counter() - t0

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

    def _admit(self) -> None:
        """Waiting jobs join the batch while it has free rows (each by its prompt forward), in the
        order of the admission rule."""
        while True:
            with self._cv:
                if self._closing or not self._jobs or len(self._rows) >= self.max_batch:
                    return
                job = self._jobs[self.admission.pick(self._jobs, [r.lane for r in self._rows])]
                self._jobs.remove(job)
            row = _Row(job, lane=min(set(range(self.max_batch)) - {r.lane for r in self._rows}))
            with self._cv:
                self._rows.append(row)  # counted as running from here (its prompt forward may take a while)
            if job.cancelled.is_set():
                self._finish([row], {id(row): None})
            else:
                self._guarded(lambda: self._prefill(row), [row])

    def _guarded(self, fn, rows: list | None = None) -> None:
        """fn(); if it raises, its rows (default: the whole batch) fail, the others go on."""
        try:
            with torch.no_grad():
                fn()
        except Exception as e:  # noqa: BLE001 - one failed request must not stop the server
            traceback.print_exc()
            failed = list(self._rows) if rows is None else [r for r in rows if r in self._rows]
            self._finish(failed, {id(r): "error" for r in failed}, f"generation failed: {type(e).__name__}: {e}")

    def _forward(self, ids: torch.Tensor, lanes: list[int], run=None, cache=None, **kwargs):
        """The model's logits for `ids` on `lanes` with `cache` (`run()`'s instead, a graph replay, when given)."""
        if self.runtime is not None:
            self.runtime.use_lanes(lanes)
        kwargs = {"input_ids": ids} | kwargs | {self._cache_kwarg: cache}
        logits = run() if run is not None else self.model(**kwargs, use_cache=True, **self._keep).logits
        self.admission.observe(ids, lanes)
        return logits

    def _prefill(self, row: _Row) -> None:
        """The job's prompt forward on its own cache; its first token; then it joins the batch's cache."""
        p = row.job.params
        row.gen = torch.Generator(device=self.device).manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        row.text = TextStream(self.tokenizer, p.stop)
        cache = self._new_cache()  # as model.generate builds it; the runtime's hooks see an empty cache as a new request
        ids = torch.tensor([row.job.prompt_ids], device=self.device)
        logits = self._forward(ids, [row.lane], cache=cache)
        row.positions += ids.shape[1]
        finish = self._next(row, logits[0, -1])
        if finish is not None:
            self._finish([row], {id(row): finish})
            return
        alone = BatchKV.alone(cache, ids.shape[1])
        self._kv = alone if self._kv is None else self._kv.join(alone)

    def _step(self) -> None:
        """One decode step over every running row; rows that end leave the batch."""
        rows, lanes = self._rows, [r.lane for r in self._rows]
        ids = torch.tensor([[r.token] for r in rows], device=self.device)
        logits = self._kv.step(lambda **kw: self._forward(ids, lanes, **kw), ids)
        ended = {}
        for i, row in enumerate(rows):
            row.positions += 1
            finish = self._next(row, logits[i, -1])
            if finish is not None:
                ended[id(row)] = finish
        if ended:
            self._finish([r for r in rows if id(r) in ended], ended)

    def _next(self, row: _Row, logits: torch.Tensor) -> str | None:
        """Choose and emit the row's next token; its finish reason when the job ends here (None: cancelled
        shows as the reason "cancelled"), else None."""
        p, job = row.job.params, row.job
        token = choose_token(logits, temperature=p.temperature, top_p=p.top_p, generator=row.gen)
        row.completion += 1
        if token in self.eos:
            return "stop"
        delta = row.text.push(token)
        if delta:
            job.emit("text", delta)
        if row.text.finished:
            return "stop"
        if row.completion >= p.max_tokens:
            return "length"
        if job.cancelled.is_set():
            return "cancelled"
        row.token = token
        return None

    def _finish(self, rows: list[_Row], reasons: dict, error: str | None = None) -> None:
        """`rows` leave the batch (and its cache) with their reasons ("stop", "length", "cancelled",
        "error" or None for a job cancelled before it ran); their last events."""
        gone = {id(r) for r in rows}
        cached = self._rows[:self._kv.rows] if self._kv is not None else []  # a row being prefilled is not (yet)
        keep = [i for i, r in enumerate(cached) if id(r) not in gone]
        if len(keep) < len(cached):
            self._kv = self._kv.keep_rows(keep)
        for row in rows:
            reason, job = reasons[id(row)], row.job
            outcome = {"error": "failed", "cancelled": "cancelled", None: "cancelled"}.get(reason, "completed")
            if outcome == "completed" and row.text is not None:
                self._flush(job, row.text)
            n = len(job.prompt_ids)
            with self._cv:
                c = self.counts_
                setattr(c, outcome, getattr(c, outcome) + 1)
                c.prompt_tokens += n if row.positions else 0
                c.completion_tokens += row.completion
                c.forward_positions += row.positions
            if job.cancelled.is_set() and outcome != "failed":
                continue
            if outcome == "completed":
                job.emit("done", reason, {"prompt_tokens": n, "completion_tokens": row.completion,
                                          "total_tokens": n + row.completion})
            elif outcome == "failed":
                job.emit("error", error)
        with self._cv:
            self._rows = [r for r in self._rows if id(r) not in gone]

    def _new_cache(self):
        from transformers import DynamicCache  # transformers: only when this runs

        return DynamicCache(config=self.model.config.get_text_config(decoder=True))

    @staticmethod
    def _flush(job: Job, text: TextStream) -> None:
        rest = text.flush()
        if rest:
            job.emit("text", rest)


@dataclass(eq=False)
class _Row:
    """A job in the running batch."""

    job: Job
    lane: int
    gen: torch.Generator | None = None
    text: TextStream | None = None
    token: int | None = None  # the last token chosen (the next step's input)
    completion: int = 0
    positions: int = 0  # positions the model ran for it


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

"""Greedy decoding whose decode step is one CUDA graph: `DecodeGraph(runtime).generate(ids, n)`.

    runtime = seqmoe.offload(model, residency=0.3, system="seqmoe", device="cuda", ...)   # control="thread"
    tokens = DecodeGraph(runtime, max_length=512).generate(input_ids, max_new_tokens=64)
    tokens = DecodeGraph(plain_model, max_length=512).generate(input_ids, 64)   # the full-load baseline

The prompt runs eagerly (its routing is fed to the state machine inline, after the control thread
has caught up). The decode step (a one-token forward against a transformers `StaticCache`, the
argmax, and the advance of the position) touches only device memory and the mapped host memory
of the slot table, the host expert rows and the routing mailbox, and reads no host value: it is
captured once (after two warm-up runs that post nothing) and replayed for every token. Which
expert sits in which slot is data in the table, so the graph never changes; the control thread
learns each step's routing from the mailbox and drives the copies, off the critical path. Before
each replay the host only waits while the control thread is half a mailbox ring behind.

On the CPU (or with `capture=False`) the same step runs eagerly: the same code and ordering, no graph.
The captured step, stage by stage: docs/decode.md, "On CUDA: posted and captured".
"""

from __future__ import annotations

import torch

from seqmoe.arch import cache_kwarg
from seqmoe.errors import UserError


class DecodeGraph:
    """Greedy generation, batch 1, up to `max_length` tokens, for an offloaded model or a plain one.

    Args:
        target: an `OffloadRuntime` from `seqmoe.offload(..., control="thread")`, or a plain
            transformers causal LM (then nothing is offloaded: the full-load baseline).
        max_length: prompt plus new tokens, at most (the static cache's length).
        capture: capture the decode step as a CUDA graph (default: on CUDA).
    """

    def __init__(self, target, max_length: int, capture: bool | None = None) -> None:
        from transformers import StaticCache

        self.runtime = target if hasattr(target, "controller") else None
        if self.runtime is not None and self.runtime.control != "thread":
            raise UserError("DecodeGraph needs the control plane on its own thread: offload(..., control='thread')")
        self.model = target.model if self.runtime is not None else target
        self.device = self.runtime.pool.device if self.runtime is not None else next(self.model.parameters()).device
        self.max_length = max_length
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise UserError("CUDA graph capture needs device='cuda'")
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_length)
        self._cache_key = cache_kwarg(self.model)
        self.token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.pos = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.out = torch.zeros((1, max_length), dtype=torch.long, device=self.device)
        self.graph = None
        self.steps = 0

    def _step(self) -> None:
        """Feed `token` at `pos`, write the argmax at pos + 1, advance: device work only."""
        logits = self.model(input_ids=self.token, position_ids=self.pos.view(1, 1), cache_position=self.pos,
                            use_cache=True, **{self._cache_key: self.cache}).logits
        nxt = logits[:, -1].argmax(-1).view(1, 1)
        self.pos.add_(1)
        self.out.index_copy_(1, self.pos, nxt)
        self.token.copy_(nxt)

    def _snapshot(self) -> list[torch.Tensor]:
        """Device state a warm-up step changes besides the KV rows it rewrites identically."""
        lengths = [getattr(layer, "cumulative_length", None) for layer in getattr(self.cache, "layers", [])]
        reads = [self.runtime.pool.device_reads] if self.runtime is not None else []
        return [t for t in [self.token, self.pos, self.out] + reads + lengths if isinstance(t, torch.Tensor)]

    def _posting(self, on: bool, muted: bool = False) -> None:
        """Tell an offloaded model's hooks that DecodeGraph runs the decode step (warm-up, capture,
        or a step it opened): they post, and neither open nor close anything."""
        if self.runtime is not None:
            ctrl = self.runtime.controller
            ctrl.graph_step, ctrl.mailbox.muted = on, muted
            if not on:
                ctrl.posting = False

    def _capture(self) -> None:
        self._posting(True, muted=True)
        try:
            state = self._snapshot()
            saved = [t.clone() for t in state]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile kernels (Triton), allocate buffers; posts nothing
                    self._step()
                    for t, s in zip(state, saved):
                        t.copy_(s)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._posting(True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step()
            self.graph = graph
        finally:
            self._posting(False)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                 check_every: int = 16) -> torch.Tensor:
        """[1, n + new] greedy tokens, what `model.generate(..., do_sample=False)` returns: new =
        `max_new_tokens`, or fewer when `eos_token_id` is generated (the output then ends with it).

        The end of sequence is looked for on the host once every `check_every` steps (the only host
        read of the loop), so up to `check_every - 1` steps past it run and are discarded (the
        runtime's trace and counts include them: the model did run them)."""
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise UserError(f"DecodeGraph serves batch 1; got input_ids of shape {tuple(input_ids.shape)}")
        n = input_ids.shape[1]
        if max_new_tokens < 1 or n + max_new_tokens > self.max_length:
            raise UserError(f"{n} prompt tokens + {max_new_tokens} new tokens do not fit max_length={self.max_length}")
        if check_every < 1:
            raise UserError(f"check_every must be >= 1, got {check_every}")
        input_ids = input_ids.to(self.device)
        self.cache.reset()
        logits = self.model(input_ids=input_ids, cache_position=torch.arange(n, device=self.device),
                            use_cache=True, **{self._cache_key: self.cache}).logits
        self.out[0, :n] = input_ids[0]
        self.pos.fill_(n)
        self.out[0, n] = logits[0, -1].argmax(-1)
        self.token[0, 0] = self.out[0, n]
        if self.capture and self.graph is None and max_new_tokens > 1:
            self._capture()
        end = n + max_new_tokens
        for i in range(max_new_tokens - 1):
            if eos_token_id is not None and i % check_every == 0:
                found = self._first_eos(n, n + i + 1, eos_token_id)
                if found is not None:
                    end = found + 1
                    break
            self._decode_step()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if self.runtime is not None and self.runtime.controller.relay is not None:
            self.runtime.controller.relay.check()  # no step's output went without its host part
        if eos_token_id is not None and end == n + max_new_tokens:
            found = self._first_eos(n, end, eos_token_id)
            end = end if found is None else found + 1
        return self.out[:, :end].clone()

    def _decode_step(self) -> None:
        """One decode step: opened and closed on the runtime's controller, the graph replayed or the step run."""
        ctrl = self.runtime.controller if self.runtime is not None else None
        if ctrl is None:
            self.graph.replay() if self.graph is not None else self._step()
            self.steps += 1
            return
        ctrl.begin_posted(None)
        try:
            if self.graph is not None:
                self.graph.replay()
                ctrl.end_posted(posted=ctrl.L)  # the replay posted every layer (no hook runs in it)
            else:
                self._posting(True)  # the hooks post without asking the cache whether this is a decode step
                try:
                    self._step()
                finally:
                    self._posting(False)
                ctrl.end_posted()
        except BaseException:  # an error or Ctrl-C between the launch and the end: the step is cut short
            ctrl.abort()
            raise
        self.steps += 1

    def _first_eos(self, lo: int, hi: int, eos: int) -> int | None:
        """Position of the first `eos` in out[lo:hi] (a host read: waits for the steps so far), or None."""
        hits = (self.out[0, lo:hi] == eos).nonzero()
        return lo + int(hits[0, 0]) if len(hits) else None

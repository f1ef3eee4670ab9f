"""Greedy decoding whose decode step is one CUDA graph: `DecodeGraph(runtime).generate(ids, n)`.

    runtime = seqmoe.offload(model, residency=0.3, system="seqmoe", device="cuda", ...)   # control="thread"
    tokens = DecodeGraph(runtime, max_length=512).generate(input_ids, max_new_tokens=64)
    tokens = DecodeGraph(plain_model, max_length=512).generate(input_ids, 64)   # the full-load baseline
    tokens = DecodeGraph(runtime, 512).generate(padded_ids, 64, attention_mask=mask)   # B rows, left padded

The prompt runs eagerly (its routing is fed to the state machine inline, after the control thread
has caught up). The decode step (a one-token forward against a transformers `StaticCache`, the
argmax, and the advance of the position) touches only device memory and the mapped host memory
of the slot table, the host expert rows and the routing mailbox, and reads no host value: it is
captured once (after two warm-up runs that post nothing) and replayed for every token. Which
expert sits in which slot is data in the table, so the graph never changes; the control thread
learns each step's routing from the mailbox and drives the copies, off the critical path. Before
each replay the host only waits while the control thread is half a mailbox ring behind.

A batch of B rows (left padded, as transformers' `generate` takes it) decodes in lockstep: each
row's position id is the shared cache position less its padding, and a fixed [B, max_length]
attention mask (the prompt's, then ones) hides the padding; every batch size has its own static
cache and graph, captured at its first use, as serving engines keep one graph per batch size.

On the CPU (or with `capture=False`) the same step runs eagerly: the same code and ordering, no graph.
The captured step, stage by stage: docs/decode.md, "On CUDA: posted and captured".
"""

from __future__ import annotations

import torch

from seqmoe.arch import cache_kwarg
from seqmoe.base.errors import UserError
from seqmoe.runtime.posted.mailbox import MAX_ROWS


class _Rows:
    """The device state of decoding B rows: a static cache, the step's inputs and outputs, its graph."""

    def __init__(self, model, batch: int, max_length: int, device: torch.device) -> None:
        from transformers import StaticCache  # transformers: only when this runs

        self.batch = batch
        self.cache = StaticCache(config=model.config, max_cache_len=max_length)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((1,), dtype=torch.long, device=device)
        self.pads = torch.zeros((batch, 1), dtype=torch.long, device=device)  # left padding of each row
        self.mask = torch.ones((batch, max_length), dtype=torch.long, device=device) if batch > 1 else None
        self.out = torch.zeros((batch, max_length), dtype=torch.long, device=device)
        self.graph = None


class DecodeGraph:
    """Greedy generation of B rows, up to `max_length` tokens each, for an offloaded model or a plain one.

    Args:
        target: an `OffloadRuntime` from `seqmoe.offload(..., control="thread")`, or a plain
            transformers causal LM (then nothing is offloaded: the full-load baseline).
        max_length: prompt plus new tokens, at most (the static caches' length).
        capture: capture the decode step as a CUDA graph (default: on CUDA).
    """

    def __init__(self, target, max_length: int, capture: bool | None = None) -> None:
        self.runtime = target if hasattr(target, "controller") else None
        if self.runtime is not None and self.runtime.control != "thread":
            raise UserError("DecodeGraph needs the control plane on its own thread: offload(..., control='thread')")
        self.model = target.model if self.runtime is not None else target
        self.device = self.runtime.pool.device if self.runtime is not None else next(self.model.parameters()).device
        self.max_length = max_length
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise UserError("CUDA graph capture needs device='cuda'")
        self._cache_key = cache_kwarg(self.model)
        self._batches: dict[int, _Rows] = {}
        self._rows = self._state(1)
        self.steps = 0

    graph = property(lambda self: self._rows.graph, doc="The captured step of the last batch size decoded (or None).")
    out = property(lambda self: self._rows.out)

    def _state(self, batch: int) -> _Rows:
        if batch not in self._batches:
            self._batches[batch] = _Rows(self.model, batch, self.max_length, self.device)
        return self._batches[batch]

    def _step(self) -> None:
        """Feed each row's token at `pos`, write the argmax at pos + 1, advance: device work only."""
        r = self._rows
        mask = {} if r.mask is None else {"attention_mask": r.mask}
        logits = self.model(input_ids=r.token, position_ids=r.pos.view(1, 1) - r.pads, cache_position=r.pos,
                            use_cache=True, **mask, **{self._cache_key: r.cache}).logits
        nxt = logits[:, -1].argmax(-1).view(r.batch, 1)
        r.pos.add_(1)
        r.out.index_copy_(1, r.pos, nxt)
        r.token.copy_(nxt)

    def _snapshot(self) -> list[torch.Tensor]:
        """Device state a warm-up step changes besides the KV rows it rewrites identically."""
        r = self._rows
        lengths = [getattr(layer, "cumulative_length", None) for layer in getattr(r.cache, "layers", [])]
        reads = [self.runtime.pool.device_reads] if self.runtime is not None else []
        return [t for t in [r.token, r.pos, r.out] + reads + lengths if isinstance(t, torch.Tensor)]

    def _posting(self, on: bool, muted: bool = False) -> None:
        """Tell an offloaded model's hooks that DecodeGraph runs the decode step (warm-up, capture,
        or a step it opened): they post, and neither open nor close anything."""
        if self.runtime is not None:
            self.runtime.controller.run_graph_steps(on, muted)

    def _capture(self) -> None:
        if self.runtime is not None:
            self.runtime.controller.mailbox.warm(self._rows.batch)  # the prompt caught the control thread up
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
            self._rows.graph = graph
        finally:
            self._posting(False)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                 check_every: int = 16, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n + new] greedy tokens, what `model.generate(..., do_sample=False)` returns: new =
        `max_new_tokens`, or fewer when every row has generated `eos_token_id` (a row that ended
        earlier is padded with it after its end, as transformers pads a finished row).
        `attention_mask`: [B, n], 0 on each row's left padding (default: no padding).

        The end of sequence is looked for on the host once every `check_every` steps (the only host
        read of the loop), so up to `check_every - 1` steps past it run and are discarded (the
        runtime's trace and counts include them: the model did run them)."""
        if input_ids.ndim != 2 or not 1 <= input_ids.shape[0] <= self._max_rows():
            raise UserError(f"DecodeGraph takes [B, n] input_ids with 1 <= B <= {self._max_rows()}; got shape "
                            f"{tuple(input_ids.shape)}")
        b, n = input_ids.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (b, n):
            raise UserError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {(b, n)}")
        if max_new_tokens < 1 or n + max_new_tokens > self.max_length:
            raise UserError(f"{n} prompt tokens + {max_new_tokens} new tokens do not fit max_length={self.max_length}")
        if check_every < 1:
            raise UserError(f"check_every must be >= 1, got {check_every}")
        if b == 1 and attention_mask is not None and not bool(attention_mask.all()):
            input_ids, attention_mask = input_ids[:, attention_mask[0].bool()], None  # one row needs no padding
            n = input_ids.shape[1]
        r = self._rows = self._state(b)
        input_ids = input_ids.to(self.device)
        r.cache.reset()
        kwargs = {}
        if b > 1:
            mask = attention_mask.to(self.device) if attention_mask is not None else torch.ones_like(input_ids)
            r.mask.fill_(1)
            r.mask[:, :n] = mask
            r.pads.copy_((n - mask.sum(-1, keepdim=True)).long())
            kwargs = {"attention_mask": mask, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}
        logits = self.model(input_ids=input_ids, cache_position=torch.arange(n, device=self.device),
                            use_cache=True, **kwargs, **{self._cache_key: r.cache}).logits
        r.out[:, :n] = input_ids
        r.pos.fill_(n)
        r.out[:, n] = logits[:, -1].argmax(-1)
        r.token[:, 0] = r.out[:, n]
        if self.capture and r.graph is None and max_new_tokens > 1:
            self._capture()
        end = n + max_new_tokens
        for i in range(max_new_tokens - 1):
            if eos_token_id is not None and i % check_every == 0:
                found = self._last_eos(n, n + i + 1, eos_token_id)
                if found is not None:
                    end = found + 1
                    break
            self._decode_step()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if self.runtime is not None and self.runtime.controller.relay is not None:
            self.runtime.controller.relay.check()  # no step's output went without its host part
        if eos_token_id is not None and end == n + max_new_tokens:
            found = self._last_eos(n, end, eos_token_id)
            end = end if found is None else found + 1
        out = r.out[:, :end].clone()
        if eos_token_id is not None:  # after a row's first end of sequence, what transformers writes: the pad
            ended = (out[:, n:] == eos_token_id).long().cumsum(-1) - (out[:, n:] == eos_token_id).long()
            out[:, n:].masked_fill_(ended > 0, eos_token_id)
        return out

    def _max_rows(self) -> int:
        return self.runtime.controller.mailbox.rows if self.runtime is not None else MAX_ROWS

    def _decode_step(self) -> None:
        """One decode step: opened and closed on the runtime's controller, the graph replayed or the step run."""
        ctrl = self.runtime.controller if self.runtime is not None else None
        r = self._rows
        if ctrl is None:
            r.graph.replay() if r.graph is not None else self._step()
            self.steps += 1
            return
        ctrl.begin_posted(None, r.batch)
        try:
            if r.graph is not None:
                r.graph.replay()
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

    def _last_eos(self, lo: int, hi: int, eos: int) -> int | None:
        """The position by which every row has generated `eos` in out[:, lo:hi] (a host read: waits
        for the steps so far), or None while a row has not."""
        hit = self._rows.out[:, lo:hi] == eos
        if not bool(hit.any(-1).all()):
            return None
        return lo + int(hit.long().argmax(-1).max())

"""Greedy decoding whose decode step is one CUDA graph: `DecodeGraph(runtime).generate(ids, n)`.

    runtime = seqmoe.offload(model, residency=0.3, system="seqmoe", device="cuda", ...)   # control="thread"
    tokens = DecodeGraph(runtime, max_length=512).generate(input_ids, max_new_tokens=64)

The prompt runs eagerly (its routing is fed to the state machine inline, after the control thread
has caught up). The decode step (a one-token forward against a transformers `StaticCache`, the
argmax, and the advance of the position) touches only device memory and the mapped host memory
of the slot table, the host expert rows and the routing mailbox, and reads no host value: it is
captured once (after two warm-up runs that post nothing) and replayed for every token. Which
expert sits in which slot is data in the table, so the graph never changes; the control thread
learns each step's routing from the mailbox and drives the copies, off the critical path. Before
each replay the host only waits while the control thread is half a mailbox ring behind.

On the CPU (or with `capture=False`) the same step runs eagerly: the same code and ordering, no graph.
Architectures whose attention transformers' `StaticCache` does not serve (the tiny DeepSeek-V3
config of the tests, transformers 5.24) fail in transformers itself.
"""

from __future__ import annotations

import torch

from seqmoe.errors import UserError


class DecodeGraph:
    """Greedy generation for an offloaded model (`control="thread"`), batch 1, up to `max_length` tokens.

    Args:
        runtime: from `seqmoe.offload(..., control="thread")`.
        max_length: prompt plus new tokens, at most (the static cache's length).
        capture: capture the decode step as a CUDA graph (default: on CUDA).
    """

    def __init__(self, runtime, max_length: int, capture: bool | None = None) -> None:
        if runtime.control != "thread":
            raise UserError("DecodeGraph needs the control plane on its own thread: offload(..., control='thread')")
        from transformers import StaticCache

        self.runtime, self.model = runtime, runtime.model
        self.device = runtime.pool.device
        self.max_length = max_length
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise UserError("CUDA graph capture needs device='cuda'")
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_length)
        self.token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.pos = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.out = torch.zeros((1, max_length), dtype=torch.long, device=self.device)
        self.graph = None
        self.steps = 0

    def _step(self) -> None:
        """Feed `token` at `pos`, write the argmax at pos + 1, advance: device work only."""
        logits = self.model(input_ids=self.token, position_ids=self.pos.view(1, 1), cache_position=self.pos,
                            past_key_values=self.cache, use_cache=True).logits
        nxt = logits[:, -1].argmax(-1).view(1, 1)
        self.pos.add_(1)
        self.out.index_copy_(1, self.pos, nxt)
        self.token.copy_(nxt)

    def _snapshot(self) -> list[torch.Tensor]:
        """Device state a warm-up step changes besides the KV rows it rewrites identically."""
        lengths = [getattr(layer, "cumulative_length", None) for layer in getattr(self.cache, "layers", [])]
        return [t for t in [self.token, self.pos, self.out, self.runtime.pool.device_reads] + lengths
                if isinstance(t, torch.Tensor)]

    def _capture(self) -> None:
        ctrl = self.runtime.controller
        ctrl.graph_step, ctrl.mailbox.muted = True, True
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
            ctrl.mailbox.muted = False
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step()
            self.graph = graph
        finally:
            ctrl.graph_step, ctrl.mailbox.muted = False, False
            ctrl.end_posted()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """[1, n + max_new_tokens] greedy tokens (what `model.generate(..., do_sample=False)` returns)."""
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise UserError(f"DecodeGraph serves batch 1; got input_ids of shape {tuple(input_ids.shape)}")
        n = input_ids.shape[1]
        if max_new_tokens < 1 or n + max_new_tokens > self.max_length:
            raise UserError(f"{n} prompt tokens + {max_new_tokens} new tokens do not fit max_length={self.max_length}")
        input_ids = input_ids.to(self.device)
        self.cache.reset()
        logits = self.model(input_ids=input_ids, cache_position=torch.arange(n, device=self.device),
                            past_key_values=self.cache, use_cache=True).logits
        self.out[0, :n] = input_ids[0]
        self.pos.fill_(n)
        self.out[0, n] = logits[0, -1].argmax(-1)
        self.token[0, 0] = self.out[0, n]
        if self.capture and self.graph is None and max_new_tokens > 1:
            self._capture()
        ctrl, pool = self.runtime.controller, self.runtime.pool
        for _ in range(max_new_tokens - 1):
            ctrl.thread.launch()
            pool.set_idle(False)
            if self.graph is not None:
                self.graph.replay()
            else:
                ctrl.graph_step = True  # the hooks post without asking the cache whether this is a decode step
                try:
                    self._step()
                finally:
                    ctrl.graph_step = False
            self.steps += 1
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        pool.set_idle(True)
        return self.out[:, :n + max_new_tokens].clone()

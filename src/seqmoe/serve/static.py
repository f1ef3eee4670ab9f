"""The running batch in one static cache (`StaticBatch`): the path `seqmoe serve` decodes on unless
`--eager`, one CUDA graph per number of rows on a GPU.

    batch = StaticBatch(model, rows=8, length=4096, cache_kwarg="cache", runtime=rt)
    batch = batch.join(BatchKV.alone(cache, n))    # a request prefilled alone takes the next row
    logits = batch.step(forward)                    # one decode step of the live rows: [b, 1, V]
    batch = batch.keep_rows([0, 2])                 # rows leave; the others move down, in order

A transformers `StaticCache` of `rows` rows x `length` positions holds every request. All rows are
written at one shared position `pos` (a `StaticLayer` writes at its `cumulative_length`): a joining
request's prompt, prefilled alone as `generate` prefills it, is copied in to end at `pos`, its
earlier positions masked, and each row's position ids count from its own start, so every row
computes what it would alone. The live rows are the first b; a step of b rows runs on a cache whose
layers are the first b rows (`_view`), and on CUDA replays the graph captured for b rows at its
first use (warm-up and capture as `DecodeGraph`'s, posting through the runtime's mailbox).
Only b rows run: a padded row would route experts, and in an offloaded model that costs copies.
Sampling stays outside the graph (each request has its own generator), on the logits it leaves.
A captured step's cache holds the whole length (its buffers never move). Run eagerly it holds what
the live rows span rounded up to `ROOM_STEP` positions, so attention costs what they need: it grows
(one copy) when `pos` reaches its end, after the positions no live row uses went (every row moves
left by the earliest live start), and shrinks when rows leave. A row never spans the
whole length (prompt + completion <= `length`); a prompt longer than `pos` moves the rows right.
"""

from __future__ import annotations

import functools

import torch

ROOM_STEP = 64
"""An eagerly run cache grows and shrinks by this many positions: attention over at most this many
unused ones, and one copy of the live rows per this many steps (a growing cache copies every step)."""


class StaticBatch:
    """Up to `rows` requests in one static cache of `length` positions (see the module docstring).

    Args:
        model: the (offloaded or plain) transformers causal LM.
        rows, length: the cache's rows and positions (the server's --max-batch and context length).
        cache_kwarg: the name of the forward's cache argument.
        runtime: the model's `OffloadRuntime` (None: a plain model); a captured step posts through it.
        capture: capture each row count's step as a CUDA graph (default: on CUDA with thread control).
    """

    def __init__(self, model, rows: int, length: int, cache_kwarg: str, runtime=None, capture: bool | None = None) -> None:
        from transformers import StaticCache  # transformers: only when this runs

        self.model, self.max_rows, self.length, self._cache_kwarg, self.runtime = model, rows, length, cache_kwarg, runtime
        self.device = next(model.parameters()).device
        config = model.config.get_text_config(decoder=True)
        self._new = lambda: StaticCache(config=config, max_cache_len=length)  # noqa: E731
        self.full = self._new()
        self.views: dict[int, object] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.live, self.pos, self.cap, self.starts = 0, 0, 0, [0] * rows
        self.mask = torch.zeros((rows, length), dtype=torch.long, device=self.device)
        self.token = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.cache_position = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.logits: torch.Tensor | None = None  # [rows, V]: what a captured step leaves
        thread = runtime is None or getattr(runtime, "control", None) == "thread"
        self.capture = (self.device.type == "cuda" and thread) if capture is None else capture

    @property
    def rows(self) -> int:
        """Live rows (the first `rows` of the cache)."""
        return self.live

    # -- rows join and leave -------------------------------------------------------------------------
    def join(self, alone) -> StaticBatch:
        """Add a request prefilled alone (`kv.BatchKV.alone`: a one-row cache of n positions) as the next row."""
        n, layers = alone.lengths[0], alone.cache.layers
        if self.live == self.max_rows:
            raise RuntimeError(f"the static batch holds {self.max_rows} rows")
        if n >= self.length:
            raise RuntimeError(f"a prompt of {n} positions leaves no room in a cache of {self.length}")
        if not self.full.layers[0].is_initialized:
            for mine, theirs in zip(self.full.layers, layers):
                mine.lazy_initialization(theirs.keys.expand(self.max_rows, -1, -1, -1)[:, :, :1],
                                         theirs.values.expand(self.max_rows, -1, -1, -1)[:, :, :1])
        if self.live == 0:
            self.pos = n
        if n > self.pos:
            self._relayout(self._room(n + 1), n - self.pos)
        elif self.pos + 1 > self.cap:
            self._relayout(self._room(self.pos + 1))
        row, at = self.live, self.pos - n
        for mine, theirs in zip(self.full.layers, layers):
            mine.keys[row, :, at:self.pos] = theirs.keys[0]
            mine.values[row, :, at:self.pos] = theirs.values[0]
        self.mask[row].zero_()
        self.mask[row, at:self.pos] = 1
        self.starts[row] = at
        self.live += 1
        return self

    def keep_rows(self, keep: list[int]) -> StaticBatch:
        """Only rows `keep` (in this order) stay: row keep[k] moves to row k."""
        lo = min(self.starts[:self.live], default=0)  # positions before it are no live row's
        for k, i in enumerate(keep):
            if i != k:
                for layer in self.full.layers:
                    layer.keys[k, :, lo:self.pos] = layer.keys[i, :, lo:self.pos]
                    layer.values[k, :, lo:self.pos] = layer.values[i, :, lo:self.pos]
                self.mask[k] = self.mask[i]
                self.starts[k] = self.starts[i]
        self.live = len(keep)
        if not self.live:
            self.pos = 0
        elif not self.capture and self._room(self.pos + 1 - min(self.starts[:self.live])) < self.cap - ROOM_STEP:
            self._relayout(self._room(self.pos + 1 - min(self.starts[:self.live])), -min(self.starts[:self.live]))
        return self

    def _room(self, need: int) -> int:
        """The capacity for `need` positions: the whole length for a captured step (its buffers never
        move), else `need` rounded up to a multiple of `ROOM_STEP`."""
        return self.length if self.capture else min(self.length, -(-need // ROOM_STEP) * ROOM_STEP)

    def _relayout(self, cap: int, by: int = 0) -> None:
        """Hold `cap` positions, every live row's positions moved `by` (> 0: right); in place when
        `cap` stays (a captured step's buffers keep their addresses)."""
        b, lo = self.live, min(self.starts[:self.live], default=self.pos)
        if cap != self.full.layers[0].keys.shape[2]:
            self.views.clear()  # new buffers: the views (and a captured graph's addresses) are of the old
            self.graphs.clear()
        for layer in self.full.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                part = old[:b, :, lo:self.pos].clone()
                new = old if cap == old.shape[2] else old.new_zeros((old.shape[0], old.shape[1], cap, old.shape[3]))
                new[:b, :, lo + by:self.pos + by] = part
                setattr(layer, name, new)
            layer.max_cache_len = cap
        part = self.mask[:b, lo:self.pos].clone()
        self.mask[:b] = 0
        self.mask[:b, lo + by:self.pos + by] = part
        self.starts[:b] = [s + by for s in self.starts[:b]]
        self.pos, self.cap = self.pos + by, cap

    # -- a decode step -------------------------------------------------------------------------------
    def step(self, forward, ids: torch.Tensor) -> torch.Tensor:
        """The live rows' next-token logits [b, 1, V] for their tokens `ids` [b, 1]. `forward(run=None,
        cache=None, **kwargs)`: the caller's forward (it sets the runtime's lanes), which calls `run()`
        instead of the model when given one (a graph replay)."""
        b = self.live
        if self.pos >= self.cap:  # no room at pos: first the positions no live row uses go, then it grows
            lo = min(self.starts[:b])
            self._relayout(self._room(self.pos + 1 - lo), -lo)
        self.mask[:b, self.pos] = 1
        self.positions[:b, 0] = torch.tensor([self.pos - s for s in self.starts[:b]], device=self.device)
        self.token[:b] = ids
        self.cache_position.fill_(self.pos)
        view = self._view(b)
        if self.capture:
            if b not in self.graphs:
                self._capture(b, view)
            logits = forward(run=lambda: self._replay(b))
        else:
            logits = forward(**self._inputs(b, view))
        self.pos += 1
        return logits

    def _inputs(self, b: int, view, cache: str = "cache") -> dict:
        span = self.cap if self.capture else self.pos + 1  # an eager step attends over the written positions only
        return {"input_ids": self.token[:b], "position_ids": self.positions[:b], "cache_position": self.cache_position,
                "attention_mask": self.mask[:b, :span], cache: view}

    def _view(self, b: int):
        """A cache whose layers are the first b rows of the full cache's (contiguous), written at `pos`:
        a captured step's each through its own device counter, an eager one's at `self.pos` (`_at_pos_class`)."""
        view = self.views.get(b)
        if view is None:
            view = self.views[b] = self._new()
            for mine, full in zip(view.layers, self.full.layers):
                mine.__dict__.update({k: v for k, v in full.__dict__.items() if k not in ("keys", "values")})
                mine.keys, mine.values, mine.batch_size = full.keys[:b], full.values[:b], b
                mine.cumulative_length = full.cumulative_length.clone()
                if not self.capture:
                    mine.__class__, mine.batch = _at_pos_class(), self
        if self.capture:
            for layer in view.layers:
                layer.cumulative_length.fill_(self.pos)
        return view

    def _run(self, b: int, view) -> None:
        """The step's device work: the forward of b rows, its last logits into the static buffer."""
        out = self.model(use_cache=True, **self._inputs(b, view, cache=self._cache_kwarg)).logits[:, -1]
        if self.logits is None:
            self.logits = torch.empty((self.max_rows, out.shape[-1]), dtype=out.dtype, device=self.device)
        self.logits[:b] = out

    def _replay(self, b: int) -> torch.Tensor:
        ctrl = self.runtime.controller if self.runtime is not None else None
        if ctrl is None:
            self.graphs[b].replay()
        else:
            ctrl.begin_posted(None, b)
            try:
                self.graphs[b].replay()
                ctrl.end_posted(posted=ctrl.L)  # the replay posted every layer (no hook runs in it)
            except BaseException:  # an error or Ctrl-C between the launch and the end: the step is cut short
                ctrl.abort()
                raise
        return self.logits[:b, None]

    def _capture(self, b: int, view) -> None:
        """Warm up twice on a side stream (posting nothing, the state put back), then capture (`DecodeGraph._capture`)."""
        ctrl = self.runtime.controller if self.runtime is not None else None
        if ctrl is not None:
            ctrl.mailbox.warm(b)
            ctrl.run_graph_steps(True, muted=True)
        try:
            counters = [layer.cumulative_length for layer in view.layers]
            saved = [t.clone() for t in counters]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile kernels, allocate buffers; each rewrites position pos identically
                    self._run(b, view)
                    for t, s in zip(counters, saved):
                        t.copy_(s)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if ctrl is not None:
                ctrl.run_graph_steps(True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._run(b, view)
            for t, s in zip(counters, saved):
                t.copy_(s)
            self.graphs[b] = graph
        finally:
            if ctrl is not None:
                ctrl.run_graph_steps(False)


@functools.cache
def _at_pos_class():
    from transformers.cache_utils import StaticLayer  # transformers: only when this runs

    class AtPos(StaticLayer):
        """A static layer written eagerly at its batch's `pos` by a slice copy: `StaticLayer.update`'s
        device counter (what a captured step needs) costs an arange, an add_ and an index_copy_ a layer."""

        batch: StaticBatch
        is_compileable = False  # run eagerly: transformers may then skip an all-ones mask (SDPA's unmasked path)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            at, n = self.batch.pos, key_states.shape[-2]
            self.keys.narrow(2, at, n).copy_(key_states)
            self.values.narrow(2, at, n).copy_(value_states)
            return self.keys[:, :, :at + n], self.values[:, :, :at + n]  # attention over the positions written only

        def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
            return self.batch.pos + query_length, 0

        def get_seq_length(self) -> int:  # where the step's query is (the mask is built from it)
            return self.batch.pos

    return AtPos

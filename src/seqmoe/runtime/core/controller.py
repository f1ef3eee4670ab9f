"""The control plane: the simulator's state machine driven live by the model's router outputs.

`Controller` drives a memory manager (`seqmoe.brain.manager`) through the same `Driver` that `simulate()`
uses over a trace: per position `token_start`, then per MoE layer `reveal` and `layer_end`, on a
virtual clock that advances by the cost model (a `ModelProfile` measured from the loaded model). So
every eviction and prefetch is the simulator's decision, and replaying `Controller.trace()` with
`simulate` reproduces the same ready/late/miss counts. As the observer of the state machine it
mirrors each load and eviction into the `ExpertPool` and queues the copies on the `CopyWorker`.

Timing of the calls against the real forward:
- a decode forward (one position) is driven inline: `token_start` and `layer` at each router's
  output (before the layer's experts run), `layer_end` once its experts have computed, so
  prefetches are issued while the model is still running;
- a forward over several positions (a prompt) can only be replayed position-major once every
  layer has routed: the calls run after the forward, and the forward itself computes each expert
  from wherever it is (pool slot or host block; both exact).

`hooks.install_hooks` connects a model to a `Controller` (forward pre/post hooks, one hook per
router, and a guard around the model's forward). The seq2seq forecaster of the `seqmoe` systems is driven like any predictor: `begin_request` at a
request's first position, `begin_token` with the position's input id (a Python int, hashed without
a vocabulary, as `simulate()` hashes the recorded trace's ids), `observe` at each reveal.

With `control="thread"` (`posted.control_thread.ControlThread`) a decode forward only posts its
routing to the mailbox from the router hooks (device ops, no host synchronisation,
graph-capturable) and the control thread feeds it to the same calls (`decode_layer`); prompt
forwards stay inline, after the thread has caught up. Those methods are the posted engine's and
live beside it (`posted.steps.PostedController`, this class with the posted half).

A forward whose model cache is empty starts a new request (as `generate` does for its prompt);
without a cache (`use_cache=False`) every forward is a request of its own.

Each forward is *open* from its pre-hook to the end of its post-hook. One that raises or is
interrupted (Ctrl-C raises KeyboardInterrupt anywhere, and torch runs always-call hooks only for
Exception) is closed by `abort`: from the forward guard as the error leaves the forward, else at
the model thread's next forward, `stats()` or `close()`. Its partial token is dropped: a decode
step cut short is `cut` on the control thread, which reads the layers it posted and drops the
rest; the mailbox numbers the next post as the next step; the fence's ledger ends the forward. The
positions already fed to the state machine stay counted (`abandoned_tokens` in `stats()`), but are
not in `trace()`, so after an interrupt `simulate()` on the trace no longer reproduces the counts
exactly; the runtime itself serves the next call at once, with the full model's outputs. A SIGINT
arriving inside one state-machine transition (a reveal, a layer end, one replayed position, the
opening or closing of a forward) is raised when it ends (`signals.critical`), so slots and
decisions never disagree.
Stage by stage, inline and posted: docs/decode.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from seqmoe.base.errors import UserError
from seqmoe.brain.manager import Driver, System
from seqmoe.brain.manager.miss_paths import MissPath
from seqmoe.runtime.core.copier import CopyWorker
from seqmoe.runtime.core.pool import ExpertPool
from seqmoe.runtime.core.signals import critical
from seqmoe.trace.schema import RoutingTrace, TraceMeta


@dataclass
class _Open:
    """The forward running between its pre-hook and the end of its post-hook."""

    thread: int
    """`threading.get_ident()` of the thread that runs it."""
    posted: bool
    """A decode step posting its routing (thread mode)."""
    launched_before: int
    """Decode steps launched before it (its own step number, once it launched one)."""
    seq: int | None = None
    """Its number in the fence's ledger (thread mode)."""


class Controller:
    """Drive a memory manager from routing events and mirror its slots into `pool` via `worker`.

    Args:
        system: the system inside the manager (built with this controller as its observer, see `attach`).
        num_layers, num_experts, top_k: L, E, K.
        meta: what `trace()` records as its source.
        pregate: live pre-gate rows (`eager.pregate.LivePregate`) for the systems that fuse them, or None.
        routing: cache-aware routing (`seqmoe.brain.rerouting.CacheAwareRouting`), or None: exact routing.
        record: keep every position's routing for `trace()` (it grows with every position).
    """

    def __init__(self, system: System, num_layers: int, num_experts: int, top_k: int, meta: TraceMeta, *,
                 pregate=None, routing=None, record: bool = True) -> None:
        self.system = system
        self.L, self.E, self.K = num_layers, num_experts, top_k
        self.meta = meta
        self.lock = threading.Lock()  # the state machine: model thread (prompts) vs control thread (decode)
        self.state = None  # the memory manager
        self.driver: Driver | None = None
        self.pool: ExpertPool | None = None
        self.worker: CopyWorker | None = None
        self.record = record
        self._ids: list[np.ndarray] = []  # per forward: [N, L, K] int16
        self._weights: list[np.ndarray] = []
        self._tokens: list[int | None] = []
        self._offsets = [0]
        self._positions = 0  # positions run whole, recorded or not
        # [B, N, L, K] ids, weights, [B][N] tokens, the rows' lanes
        self._forward: tuple[np.ndarray, np.ndarray, list[list[int | None]], list[int] | None] | None = None
        self._replaying: threading.Thread | None = None  # a prompt's positions replaying after its forward
        self._replay_error: BaseException | None = None
        self._next_layer = 0
        self._shape = (0, top_k)
        self._new_request = True
        self.host_s = 0.0  # seconds in the model hooks (routing events, control plane); see `OffloadRuntime.stats`
        # The posted engine's parts (`posted.steps.PostedController`); None here: inline control.
        self.thread = self.mailbox = self.fence = self.relay = None
        self.posting = False  # a decode forward posting to the mailbox is running (thread mode)
        self.graph_step = False  # DecodeGraph runs a decode step it launched itself (or warms up, captures)
        self.routing = routing
        self._token_input: torch.Tensor | None = None
        self._posted = 0  # layers the running posting forward has posted
        self._step: tuple[np.ndarray, np.ndarray, int | None] | None = None  # the decode step being read
        self._open: _Open | None = None
        self._mid_token = False  # the driver got a token_start and not yet its last layer_end
        self.abandoned = 0  # tokens the state machine saw in part (a forward cut short)
        self._on_host: set[int] = set()  # uids the manager sent to the host CPU at the current reveal
        self._twins: set[int] = set()  # uids the manager gave to their low-bit twins at the current reveal
        self.pregate = pregate
        self.lanes: list[int] | None = None  # the lanes of the forwards' rows (`OffloadRuntime.use_lanes`); None: 0..B-1

    def attach(self, manager, pool: ExpertPool, worker: CopyWorker, disk=None) -> None:
        """`disk`: the disk tier on the virtual clock (`seqmoe.brain.manager.disk_clock.DiskClock`), or None."""
        self.state, self.pool, self.worker = manager, pool, worker
        self.driver = Driver(manager, disk=disk)
        if disk is not None:
            disk.attach(manager)

    @property
    def clock(self) -> float:
        """The virtual clock (cost-model seconds of every position replayed so far)."""
        return self.driver.clock

    # -- observer of the state machine --------------------------------------------------------------
    def on_load(self, uid: int, demand: bool, deadline_step: int) -> None:
        slot, gen = self.pool.assign(uid)
        self.worker.submit(uid, slot, gen, demand, deadline_step)

    def on_promote(self, uid: int) -> None:
        slot = self.pool.slot_of[uid]
        self.worker.submit(uid, slot, self.pool.gen[slot], True, 0)

    def on_evict(self, uid: int) -> None:
        self.pool.release(uid)

    def on_off_pool(self, uid: int, path: MissPath) -> None:
        if path.on_host_cpu:  # an in-place read needs nothing here: a row without a slot is read from its host block
            self._on_host.add(uid)
        elif path.twin:
            self._twins.add(uid)

    def off_pool_experts(self, layer: int) -> tuple[frozenset[int], frozenset[int]]:
        """(the expert ids of `layer` the manager sent to the host CPU, those it gave to their twins)
        for the decode step being computed inline (empty otherwise: a prompt forward computes
        every expert where it is)."""
        if not (self._on_host or self._twins) or self._forward is None or len(self._forward[2][0]) != 1:
            return frozenset(), frozenset()
        base = layer * self.E
        return tuple(frozenset(u - base for u in s if base <= u < base + self.E) for s in (self._on_host, self._twins))

    # -- routing events (model hooks) ------------------------------------------------------------------
    def begin_forward(self, tokens: list, new_request: bool) -> None:
        """A forward starts over `tokens`: [N] ids of one sequence, or [B][N] of a batch of B rows
        (one lane each, `seqmoe.brain.predict.lanes`); `new_request`: its cache was empty (every row's)."""
        rows = tokens if tokens and isinstance(tokens[0], list) else [tokens]
        if new_request and self.record and len(rows) == 1 and self._offsets[-1] < len(self._tokens):
            self._offsets.append(len(self._tokens))
        b, n = len(rows), len(rows[0])
        self._forward = (np.zeros((b, n, self.L, self.K), np.int16), np.zeros((b, n, self.L, self.K), np.float32), rows,
                         self.lanes)
        self._new_request = new_request
        self._next_layer = 0
        self._shape = (b * n, self.K)

    def route(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """Layer `layer`'s router chose `ids` [B * N, K] with `weights` for the forward's B rows of N positions."""
        if self._forward is None:
            raise RuntimeError("a router ran outside a model forward; call the model, not its layers")
        buf_ids, buf_w, tokens, lanes = self._forward
        if layer != self._next_layer or ids.shape != self._shape:
            raise RuntimeError(f"MoE layer {layer} routed {ids.shape} out of order (expected layer "
                               f"{self._next_layer}, shape {self._shape})")
        with critical():
            b, n = buf_ids.shape[:2]
            buf_ids[:, :, layer] = ids.reshape(b, n, self.K)
            buf_w[:, :, layer] = weights.reshape(b, n, self.K)
            self._next_layer = layer + 1
            self._on_host.clear()
            self._twins.clear()
            if n == 1:  # a decode step: driven as it routes
                if layer == 0:
                    self._step_start([row[0] for row in tokens], lanes)
                if b == 1:
                    self.driver.reveal(layer, buf_ids[0, 0, layer], weights=buf_w[0, 0, layer])
                else:
                    self.driver.reveal(layer, buf_ids[:, 0, layer], weights=buf_w[:, 0, layer])

    def experts_done(self, layer: int) -> None:
        """Layer `layer`'s experts finished computing."""
        if self._forward is not None and len(self._forward[2][0]) == 1:
            with critical():
                self._layer_end(layer)

    def end_forward(self) -> None:
        """The forward ended: replay a multi-position forward; record the positions. A forward that
        stopped early (an exception) keeps nothing, and its partial token is dropped."""
        if self._forward is None:
            return
        fwd, self._forward = self._forward, None
        if self._next_layer != self.L:
            self._drop_partial_token()
            return
        self._replay(*fwd, new_request=self._new_request)

    def _replay(self, ids, weights, tokens, lanes, *, new_request: bool) -> None:
        """Feed the forward's positions not yet driven to the state machine, position-major, and record
        them. A replay cut short (Ctrl-C between positions) records the positions the state machine saw whole."""
        b, n = ids.shape[:2]
        done = 1 if n == 1 else 0  # one position was driven as it routed
        try:
            while done < n:
                with critical():  # one position at a time: a long prompt's replay stays interruptible
                    self._step_start([row[done] for row in tokens], lanes, new_request=new_request and done == 0)
                    for l in range(self.L):
                        if b == 1:
                            self.driver.reveal(l, ids[0, done, l], weights=weights[0, done, l])
                        else:
                            self.driver.reveal(l, ids[:, done, l], weights=weights[:, done, l])
                        self._layer_end(l)
                    done += 1
        finally:
            if done:
                self._keep(ids[:, :done], weights[:, :done], [row[:done] for row in tokens])

    # -- the lifetime of a forward (model thread) ----------------------------------------------------
    def open_forward(self, posted: bool) -> None:
        """A forward starts on this thread. A previous one of this thread that never ended (it was
        interrupted outside the guard) is aborted first; one of another thread is an error."""
        me, prev = threading.get_ident(), self._open
        if prev is not None and prev.thread != me:
            raise RuntimeError("a forward started while another thread's forward runs; the runtime serves one "
                               "forward at a time (batch 1)")
        with critical():
            self.abort()
            launched = self.thread.launched if self.thread is not None else 0
            self._open = _Open(me, posted, launched)
            if self.fence is not None:
                self._open.seq = self.fence.begin()

    def begin_inline(self, tokens: list[int | None], new_request: bool) -> None:
        """A forward whose routing this thread feeds to the state machine itself (inline mode, prompts)."""
        with critical():
            self.open_forward(posted=False)
            with self.lock:
                self.begin_forward(tokens, new_request)

    def end_inline(self) -> None:
        """The post-hook of an inline forward: its device work is queued, then its positions replay; a
        prompt's replay runs on a thread of its own, so the first token does not wait for it (the
        next forward, `stats()` and `close()` do: `settle`)."""
        with critical():
            self._end_ledger()
        with self.lock:
            fwd = self._forward
            if fwd is not None and fwd[0].shape[1] > 1 and self._next_layer == self.L:
                self._forward = None
                replay = threading.Thread(target=self._replay_aside, args=fwd, kwargs={"new_request": self._new_request},
                                          name="seqmoe-replay", daemon=True)
                replay.start()  # then published: `settle` on another thread (stats) joins a started thread
                self._replaying = replay
            else:
                self.end_forward()
        self._open = None

    def _replay_aside(self, *fwd, new_request: bool) -> None:
        with self.lock:
            try:
                self._replay(*fwd, new_request=new_request)
            except BaseException as e:  # noqa: BLE001 - raised on the model thread by `settle`
                self._drop_partial_token()
                self._replay_error = e

    def settle(self) -> None:
        """Wait for a prompt's replay running aside (Ctrl-C gets through the wait); an error it met is
        raised here, once, on the caller's thread."""
        t = self._replaying
        if t is None:
            return
        t.join()
        self._replaying = None
        err, self._replay_error = self._replay_error, None
        if err is not None:
            raise err

    def end_open(self) -> None:
        """Post-hook: close this thread's open forward (DecodeGraph closes its own steps; an aborted
        one is closed; another thread's, refused at its pre-hook, is not ours to close)."""
        o = self._open
        if self.graph_step or o is None or o.thread != threading.get_ident():
            return
        if o.posted:
            self.end_posted()
        else:
            self.end_inline()

    def end_posted(self, posted: int | None = None) -> None:
        """Close a decode step that posted its routing: the posted engine's (`PostedController`)."""
        raise RuntimeError("a posted decode step needs the posted engine's controller (control='thread')")

    def _abort_posted(self, o: _Open) -> None:
        """Cut short a decode step that posted its routing: the posted engine's (`PostedController`)."""
        raise RuntimeError("a posted decode step needs the posted engine's controller (control='thread')")

    def abort(self) -> None:
        """Close the open forward of this thread as cut short (idempotent): after an exception or
        KeyboardInterrupt anywhere in it or in its hooks. The runtime is then ready for the next one."""
        o = self._open
        if o is None or o.thread != threading.get_ident():
            return
        with critical():
            if o.posted:
                self._abort_posted(o)
            else:
                with self.lock:
                    self._forward = None
                    self._drop_partial_token()
            self.posting, self._token_input = False, None
            self._end_ledger()
            self._open = None

    def _end_ledger(self) -> None:
        o = self._open
        if o is not None and o.seq is not None and self.fence is not None:
            seq, o.seq = o.seq, None
            self.fence.end(seq)

    def _drop_partial_token(self) -> None:
        """The driver saw part of a token that will not finish: count it and start the next one afresh."""
        if self._mid_token:
            self._mid_token = False
            self.abandoned += 1
            self.driver.abandon()  # positions are numbered by steps: none is numbered twice

    def _keep(self, ids: np.ndarray, weights: np.ndarray, tokens: list[list[int | None]]) -> None:
        """Count the positions run whole ([B, N, L, K] routing of B rows); record them at batch 1
        (`trace()` holds batch-1 forwards only: the simulator replays batches by its own schedule)."""
        self._positions += sum(len(row) for row in tokens)
        if self.record and len(tokens) == 1:
            self._ids.append(ids[0])
            self._weights.append(weights[0])
            self._tokens += tokens[0]

    def _step_start(self, tokens: list[int | None], lanes: list[int] | None = None,
                    new_request: bool | None = None) -> None:
        """A decode step starts over one token per row (batch 1: a token of the one sequence), the rows on `lanes`."""
        self._mid_token = True  # set first: an interrupt inside token_start still drops the token
        new = self._new_request if new_request is None else new_request
        if lanes is not None and len(lanes) != len(tokens):
            raise UserError(f"a forward of {len(tokens)} rows ran with {len(lanes)} lanes set (runtime.use_lanes)")
        if len(tokens) == 1 and lanes in (None, [0]):
            self.driver.token_start(tokens[0], new)
        else:
            self.driver.step_start(tokens, [new] * len(tokens), lanes)

    def _layer_end(self, layer: int) -> None:
        self.driver.layer_end(layer)
        if layer == self.L - 1:
            self._mid_token = False

    # -- results ---------------------------------------------------------------------------------------
    @property
    def forward_rows(self) -> int:
        """Sequences in the forward being routed (1 outside one)."""
        return 1 if self._forward is None else self._forward[0].shape[0]

    @property
    def num_tokens(self) -> int:
        return self._positions

    def trace(self) -> RoutingTrace | None:
        """The routing of every position run so far, requests back to back; None before the first."""
        if not self._tokens:
            return None
        tokens = None if any(t is None for t in self._tokens) else np.asarray(self._tokens, np.int32)
        offsets = self._offsets + ([len(self._tokens)] if self._offsets[-1] < len(self._tokens) else [])
        return RoutingTrace(
            expert_ids=np.concatenate(self._ids), gate_weights=np.concatenate(self._weights), token_ids=tokens,
            request_offsets=np.asarray(offsets, np.int64), meta=self.meta,
        )

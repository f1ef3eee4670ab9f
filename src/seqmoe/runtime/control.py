"""The control plane: the simulator's state machine driven live by the model's router outputs.

`Controller` drives a memory manager (`seqmoe.manager`) through the same `Driver` that `simulate()`
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

`install_hooks` connects a model to a `Controller` (forward pre/post hooks, one hook per router).
The seq2seq forecaster of the `seqmoe` systems is driven like any predictor: `begin_request` at a
request's first position, `begin_token` with the position's input id (a Python int, hashed without
a vocabulary, as `simulate()` hashes the recorded trace's ids), `observe` at each reveal.

With `control="thread"` (`control_thread.ControlThread`) a decode forward only posts its routing to the
mailbox from the router hooks (device ops, no host synchronisation, graph-capturable) and the
control thread feeds it to the same calls (`decode_layer`); prompt forwards stay inline, after the
thread has caught up.

A forward whose model cache is empty starts a new request (as `generate` does for its prompt);
without a cache (`use_cache=False`) every forward is a request of its own. If a forward fails
midway (e.g. the system finds no slot), the positions already fed to the state machine stay
counted but are not recorded in `trace()`: offload again after such an error.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from seqmoe.arch import unpack_router_output
from seqmoe.errors import UserError
from seqmoe.manager import Driver, System
from seqmoe.runtime.copier import CopyWorker
from seqmoe.runtime.pool import ExpertPool
from seqmoe.trace.schema import RoutingTrace, TraceMeta


class Controller:
    """Drive a memory manager from routing events and mirror its slots into `pool` via `worker`.

    Args:
        system: the system inside the manager (built with this controller as its observer, see `attach`).
        num_layers, num_experts, top_k: L, E, K.
        meta: what `trace()` records as its source.
    """

    def __init__(self, system: System, num_layers: int, num_experts: int, top_k: int, meta: TraceMeta) -> None:
        self.system = system
        self.L, self.E, self.K = num_layers, num_experts, top_k
        self.meta = meta
        self.lock = threading.Lock()  # the state machine: model thread (prompts) vs control thread (decode)
        self.state = None  # the memory manager
        self.driver: Driver | None = None
        self.pool: ExpertPool | None = None
        self.worker: CopyWorker | None = None
        self._ids: list[np.ndarray] = []  # per forward: [N, L, K] int16
        self._weights: list[np.ndarray] = []
        self._tokens: list[int | None] = []
        self._offsets = [0]
        self._forward: tuple[np.ndarray, np.ndarray, list[int | None]] | None = None
        self._next_layer = 0
        self._shape = (0, top_k)
        self._new_request = True
        self.host_s = 0.0  # seconds in the model hooks (routing events, control plane); see `OffloadRuntime.stats`
        self.thread = None  # control_thread.ControlThread when the control plane runs on its own thread
        self.mailbox = None
        self.posting = False  # a decode forward posting to the mailbox is running (thread mode)
        self.graph_step = False  # DecodeGraph runs a decode step it launched itself (or warms up, captures)
        self._token_input: torch.Tensor | None = None
        self._posted = 0  # layers the running posting forward has posted
        self._step: tuple[np.ndarray, np.ndarray, int | None] | None = None  # the decode step being read

    def attach(self, manager, pool: ExpertPool, worker: CopyWorker) -> None:
        self.state, self.pool, self.worker = manager, pool, worker
        self.driver = Driver(manager)

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

    # -- routing events (model hooks) ------------------------------------------------------------------
    def begin_forward(self, tokens: list[int | None], new_request: bool) -> None:
        """A forward over `len(tokens)` positions starts; `new_request`: its cache was empty."""
        if self._forward is not None:
            raise RuntimeError("a forward started before the previous one ended (nested or concurrent forwards)")
        if new_request and self._offsets[-1] < len(self._tokens):
            self._offsets.append(len(self._tokens))
        n = len(tokens)
        self._forward = (np.zeros((n, self.L, self.K), np.int16), np.zeros((n, self.L, self.K), np.float32), tokens)
        self._new_request = new_request
        self._next_layer = 0
        self._shape = (n, self.K)

    def route(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """Layer `layer`'s router chose `ids` [N, K] with `weights` for the forward's N positions."""
        if self._forward is None:
            raise RuntimeError("a router ran outside a model forward; call the model, not its layers")
        buf_ids, buf_w, tokens = self._forward
        if layer != self._next_layer or ids.shape != self._shape:
            raise RuntimeError(f"MoE layer {layer} routed {ids.shape} out of order (expected layer "
                               f"{self._next_layer}, shape {self._shape}); batch-1 forwards only")
        buf_ids[:, layer], buf_w[:, layer] = ids, weights
        self._next_layer = layer + 1
        if self._shape[0] == 1:
            if layer == 0:
                self._token_start(tokens[0])
            self.driver.reveal(layer, buf_ids[0, layer])

    def experts_done(self, layer: int) -> None:
        """Layer `layer`'s experts finished computing."""
        if self._forward is not None and len(self._forward[2]) == 1:
            self.driver.layer_end(layer)

    def end_forward(self) -> None:
        """The forward ended: replay a multi-position forward; record the positions."""
        if self._forward is None:
            return
        ids, weights, tokens = self._forward
        self._forward = None
        if self._next_layer != self.L:  # the forward stopped early (an exception): keep nothing of it
            return
        if len(tokens) > 1:
            for i, tok in enumerate(tokens):
                self._token_start(tok, new_request=self._new_request and i == 0)
                for l in range(self.L):
                    self.driver.reveal(l, ids[i, l])
                    self.driver.layer_end(l)
        self._ids.append(ids)
        self._weights.append(weights)
        self._tokens += tokens

    # -- decode steps read from the mailbox (control thread) --------------------------------------------
    def begin_posted(self, token_input: torch.Tensor | None) -> None:
        """A decode forward that posts its routing starts (model thread); `token_input`: its input id [1]."""
        if not self.graph_step:
            self.thread.launch()
        self.pool.set_idle(False)
        self.posting, self._token_input, self._posted = True, token_input, 0

    def end_posted(self) -> None:
        """The posting forward returned or raised (model thread); on the CPU its reads are then all
        done. A forward that posted fewer than L layers (it raised midway) leaves the control thread
        waiting for routing that never comes: it is failed, so the next call says so at once."""
        if self.posting and self._posted != self.L:
            self.thread.fail(RuntimeError(f"a decode forward stopped after {self._posted} of {self.L} MoE layers; "
                                          "the runtime lost that step: restore() and offload the model again"))
        self.posting, self._token_input = False, None
        if self.pool.device.type == "cpu":
            self.pool.set_idle(True)

    def post(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Router hook of a posting forward: device ops only."""
        self.mailbox.post(layer, ids, weights, self._token_input if layer == 0 else None)
        self._posted += 1

    def decode_layer(self, layer: int, ids: np.ndarray, weights: np.ndarray, token: int | None) -> None:
        """One layer of a posted decode step, in order (control thread): what `route` and
        `experts_done` do for a one-position forward, and `end_forward` after the last layer."""
        if layer == 0:
            self._step = (np.zeros((1, self.L, self.K), np.int16), np.zeros((1, self.L, self.K), np.float32), token)
            self._token_start(token, new_request=False)
        step_ids, step_w, tok = self._step
        step_ids[0, layer], step_w[0, layer] = ids, weights
        self.driver.reveal(layer, step_ids[0, layer])
        self.driver.layer_end(layer)
        if layer == self.L - 1:
            self._ids.append(step_ids)
            self._weights.append(step_w)
            self._tokens.append(tok)

    def _token_start(self, token: int | None, new_request: bool | None = None) -> None:
        self.driver.token_start(token, self._new_request if new_request is None else new_request)

    # -- results ---------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

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


# -- the model hooks that feed a Controller ---------------------------------------------------------------
def install_hooks(controller: Controller, model: torch.nn.Module, routers: list[torch.nn.Module]) -> list:
    """Hook `model` (forward start and end) and its MoE `routers` (layer order) to `controller`; the handles."""
    hooks = [model.register_forward_pre_hook(_pre_hook(controller), with_kwargs=True),
             model.register_forward_hook(_post_hook(controller), always_call=True)]
    return hooks + [r.register_forward_hook(_router_hook(controller, l)) for l, r in enumerate(routers)]


def _pre_hook(controller: Controller):
    def hook(module, args, kwargs):
        t0 = time.perf_counter()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            shape, tokens = ids.shape, None
        else:
            emb = kwargs.get("inputs_embeds")
            if emb is None:
                raise UserError("the offloaded model was called without input_ids or inputs_embeds")
            shape, tokens = emb.shape[:2], [None] * emb.shape[1]
        if len(shape) != 2 or shape[0] != 1:
            raise UserError(f"the offload runtime serves batch 1; got inputs of shape {tuple(shape)}")
        thread = controller.thread
        if controller.graph_step:  # DecodeGraph's decode step: nothing here may read a device value
            controller.begin_posted(ids[:, -1] if ids is not None else None)
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        new_request = cache is None or not hasattr(cache, "get_seq_length") or bool(cache.get_seq_length() == 0)
        if thread is not None and shape[1] == 1 and not new_request and (controller.num_tokens or thread.launched):
            controller.begin_posted(ids[:, -1] if ids is not None else None)
            controller.host_s += time.perf_counter() - t0
            return
        if thread is not None:  # a prompt: the state machine must be current, the device idle
            thread.catch_up()
            if controller.pool.device.type == "cuda":
                torch.cuda.current_stream(controller.pool.device).synchronize()
            controller.pool.set_idle(True)
        if tokens is None:
            tokens = ids[0].tolist()
        with controller.lock:
            controller.begin_forward(tokens, new_request or controller.num_tokens == 0)
        controller.host_s += time.perf_counter() - t0

    return hook


def _post_hook(controller: Controller):
    def hook(module, args, output):
        t0 = time.perf_counter()
        if controller.posting:
            controller.end_posted()
        else:
            with controller.lock:
                controller.end_forward()
        controller.host_s += time.perf_counter() - t0

    return hook


def _host(x: torch.Tensor) -> np.ndarray:
    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    return x.float().numpy() if x.dtype in (torch.bfloat16, torch.float16) else x.numpy()


def _router_hook(controller: Controller, layer: int):
    def hook(module, args, output):
        t0 = time.perf_counter()
        _, weights, ids = unpack_router_output(module, output)
        if controller.posting:
            controller.post(layer, ids, weights)
        else:
            controller.route(layer, _host(ids), _host(weights))  # cast to int16 / float32 by the controller
        controller.host_s += time.perf_counter() - t0

    return hook

"""The hooks that feed a `Controller` from a transformers model, all on module instances.

    handles = install_hooks(controller, model, routers)   # each with .remove()

- a forward pre-hook on the model: checks the batch (B > 1 only with inline control), opens the forward (inline, or a posting decode
  step in thread mode; a prompt first waits for the control thread);
- a forward post-hook (always called on Exception): closes it (the prompt's positions replay);
- one forward hook per MoE router: its routing, inline (host values) or posted (device ops);
- a guard around the model instance's `forward` (an attribute of the instance, as accelerate's
  hooks do): an error leaving the forward, KeyboardInterrupt included, aborts the open forward at
  once. torch runs always-call hooks on Exception only, so without it an interrupted forward would
  stay open until the next call.
Where each hook sits in a decode step: docs/decode.md.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from seqmoe.arch import unpack_router_output
from seqmoe.base.errors import UserError
from seqmoe.runtime.core.controller import Controller


def install_hooks(controller: Controller, model: torch.nn.Module, routers: list[torch.nn.Module]) -> list:
    """Hook `model` (forward start, end and guard) and its MoE `routers` (layer order) to `controller`; the handles."""
    hooks = [model.register_forward_pre_hook(_pre_hook(controller), with_kwargs=True),
             model.register_forward_hook(_post_hook(controller), always_call=True)]
    hooks += [r.register_forward_hook(_router_hook(controller, l)) for l, r in enumerate(routers)]
    return hooks + [_ForwardGuard(controller, model)]


class _ForwardGuard:
    """`model.forward` wrapped on the instance: an error leaving it aborts the controller's open forward."""

    def __init__(self, controller: Controller, model: torch.nn.Module) -> None:
        forward = model.forward

        @functools.wraps(forward)  # transformers reads forward's signature (through __wrapped__)
        def guarded(*args, **kwargs):
            try:
                return forward(*args, **kwargs)
            except BaseException:
                controller.abort()
                raise

        self.model, self.guarded = model, guarded
        model.forward = guarded

    def remove(self) -> None:
        if self.model.__dict__.get("forward") is self.guarded:
            del self.model.forward


def _inputs(args, kwargs) -> tuple[torch.Tensor | None, list | None, int]:
    """(input_ids or None, [[None] * T] * B when only embeddings are given, B)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None:
        shape, tokens = ids.shape, None
    else:
        emb = kwargs.get("inputs_embeds")
        if emb is None:
            raise UserError("the offloaded model was called without input_ids or inputs_embeds")
        shape, tokens = emb.shape[:2], [[None] * emb.shape[1] for _ in range(emb.shape[0])]
    if len(shape) != 2 or shape[0] < 1:
        raise UserError(f"the offload runtime takes inputs of shape [batch, positions]; got {tuple(shape)}")
    return ids, tokens, int(shape[0])


def _pre_hook(controller: Controller):
    def hook(module, args, kwargs):
        t0 = time.perf_counter()
        controller.settle()  # the previous prompt's replay: what follows reads the state machine
        ids, tokens, batch = _inputs(args, kwargs)
        if controller.graph_step:  # DecodeGraph opened the step: nothing here may read a device value
            controller.graph_pre(ids[:, -1] if ids is not None else None)
            return
        thread = controller.thread
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # renamed during v5: both names
        new_request = cache is None or not hasattr(cache, "get_seq_length") or bool(cache.get_seq_length() == 0)
        n = ids.shape[1] if ids is not None else len(tokens[0])
        if thread is not None and n == 1 and not new_request and (controller.num_tokens or thread.launched):
            controller.begin_posted(ids[:, -1] if ids is not None else None, batch)
            controller.host_s += time.perf_counter() - t0
            return
        if thread is not None:  # a prompt: the state machine must be current, every post run (see pool)
            controller.abort()  # this thread's earlier forward, if it never ended, is not waited for
            thread.catch_up()
        if tokens is None:
            tokens = ids.tolist()
        controller.begin_inline(tokens, new_request or controller.num_tokens == 0)
        controller.host_s += time.perf_counter() - t0

    return hook


def _post_hook(controller: Controller):
    def hook(module, args, output):
        t0 = time.perf_counter()
        controller.end_open()
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
        logits, weights, ids = unpack_router_output(module, output)
        if controller.pregate is not None and args:  # the input later routers score (`runtime.pregate`)
            controller.pregate.note_input(layer, args[0], controller.driver.tokens, controller.forward_rows)
        routing = controller.routing
        if routing is not None:  # cache-aware routing: the block computes what is returned
            weights, ids = routing(layer, logits, weights, ids, posted=controller.posting)
        if controller.posting:
            controller.post(layer, ids, weights)
        else:
            controller.route(layer, _host(ids), _host(weights))  # cast to int16 / float32 by the controller
        controller.host_s += time.perf_counter() - t0
        return None if routing is None else (logits, weights, ids)

    return hook

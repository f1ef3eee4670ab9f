"""Real-size models driven by real routing: a model of a published architecture and size with
seeded random weights (`seqmoe.arch.published.build_model`), its routers forced to a recorded trace.

    model = build_model("deepseek-v2-lite", width_divisor=16)    # random weights, all 27 layers
    forced = ForcedRouting(model, replay)                          # routers return the trace's experts
    forced.start(request_offset)                                   # before each request's prompt

The time an expert takes to copy and to compute does not depend on its values, so a model of the
real shapes whose routers pick the experts a real model picked on real text costs what the real
one costs. `ForcedRouting` replaces each MoE router's output (weights and ids) by the trace's row
of the position being computed, and the input token by the trace's token, so a forecaster sees the
ids the simulator feeds it; both are device indexing by the forward's `cache_position` (plus a
request offset set between requests), so a captured CUDA graph replays them. The router logits are
the model's own (nothing reads them at inference). `replay.replay_bench` (`benchmarks/realsize.py`) runs
the full model and the offloaded systems over the same replay.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from seqmoe.arch import model_arch, unpack_router_output
from seqmoe.base.errors import UserError
from seqmoe.trace.schema import RoutingTrace, check_dims


def layers_of(trace: RoutingTrace, num_layers: int) -> RoutingTrace:
    """`trace` cut to its first `num_layers` MoE layers (a model built with fewer layers)."""
    if num_layers == trace.num_layers:
        return trace
    cut = (lambda a: None if a is None else a[:, :num_layers])
    return dataclasses.replace(trace, expert_ids=trace.expert_ids[:, :num_layers],
                               gate_weights=cut(trace.gate_weights), pregate_logits=None,
                               router_logits=cut(trace.router_logits))


class ForcedRouting:
    """Make `model`'s routers return `trace`'s routing, position for position (see the module doc).

    Args:
        model: a transformers MoE causal LM with the trace's L, E and K (checked).
        trace: the routing to force; its gate weights when it has them, else 1/K each; its token
            ids as the input tokens when it has them.
    """

    def __init__(self, model, trace: RoutingTrace) -> None:
        arch = model_arch(model)
        check_dims("forced trace", trace, arch, "record it from this architecture", against="the model")
        device = next(model.parameters()).device
        self.ids = torch.as_tensor(trace.expert_ids.astype(np.int64), device=device)  # [T, L, K]
        K = trace.top_k
        weights = trace.gate_weights if trace.gate_weights is not None else np.full(trace.expert_ids.shape, 1.0 / K)
        self.weights = torch.as_tensor(np.asarray(weights, dtype=np.float32), device=device)
        self.tokens = None if trace.token_ids is None else torch.as_tensor(trace.token_ids.astype(np.int64),
                                                                           device=device)
        if self.tokens is not None and int(self.tokens.max()) >= model.config.vocab_size:
            raise UserError(f"token id {int(self.tokens.max())} >= the model's vocabulary ({model.config.vocab_size})")
        self.offset = torch.zeros((1,), dtype=torch.long, device=device)  # the request's first trace position
        self._rows: torch.Tensor | None = None  # trace positions of the current forward
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True)]
        self._handles += [m.router.register_forward_hook(self._hook(l), prepend=True) for l, m in enumerate(arch.moe)]

    def start(self, offset: int) -> None:
        """The next forward is the prompt of the request at trace position `offset`."""
        self.offset.fill_(offset)

    def _pre(self, module, args, kwargs):
        pos = kwargs.get("cache_position")
        if pos is None or args:
            raise UserError("forced routing needs the forward called with keywords, cache_position included")
        self._rows = self.offset + pos
        if self.tokens is not None:
            kwargs["input_ids"] = self.tokens[self._rows].view(1, -1)
        return args, kwargs

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, weights, ids = unpack_router_output(module, output)
            return logits, self.weights[self._rows, layer].to(weights.dtype), self.ids[self._rows, layer].to(ids.dtype)

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

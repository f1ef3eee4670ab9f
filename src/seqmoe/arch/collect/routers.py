"""Record what the MoE routers of a transformers causal LM choose, through forward hooks.

    layers = moe_layers(model)                 # one MoeLayer per MoE decoder layer, dense ones skipped
    with RouterRecorder(layers, pregate=2, router_logits=True) as rec:
        model(input_ids)
        ids, weights, pregate, logits = rec.take()   # [N, L, K], [N, L, K], [N, L, 2, E], [N, L, E]

Where the routers are and what they return is the architecture adapter's (`seqmoe.arch`): every
supported v5 router returns `(router_logits, top_k_weights, top_k_index)` over the flattened
tokens and its block feeds exactly those weights and indices to its experts, so the hooks record
outputs 2 and 1 as the expert ids and gate weights, in the router's output order. Shared experts
are not recorded. Hooks live on module instances only; transformers' classes are never patched.
"""

from __future__ import annotations

import numpy as np
import torch

from seqmoe.arch import MoeLayer, moe_layers, unpack_router_output
from seqmoe.base.errors import UserError

__all__ = ["MoeLayer", "RouterRecorder", "moe_layers"]


class RouterRecorder:
    """Forward hooks on the routers of `layers` that keep every position's routing until `take()`.

    Args:
        layers: from `moe_layers(model)`.
        pregate: H >= 0; when positive, also apply the routers of MoE layers l+1..l+H to the input
            of layer l's router (under no_grad, bypassing hooks) and keep their logits as float16.
        router_logits: also keep each router's own logits (float32).
    """

    def __init__(self, layers: list[MoeLayer], *, pregate: int = 0, router_logits: bool = False) -> None:
        if pregate < 0:
            raise UserError(f"pre-gating horizon must be >= 0, got {pregate}")
        self.layers = layers
        self.pregate = pregate
        self.router_logits = router_logits
        self._handles: list = []
        self._reset()

    def _reset(self) -> None:
        self._ids: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._weights: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._pre: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._logits: list[list[torch.Tensor]] = [[] for _ in self.layers]

    def __enter__(self) -> RouterRecorder:
        for l, layer in enumerate(self.layers):
            self._handles.append(layer.router.register_forward_hook(self._hook(l), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, l: int):
        def hook(module, args, kwargs, output):
            logits, weights, ids = unpack_router_output(module, output)
            self._ids[l].append(ids.detach().to("cpu", torch.int16))
            if self.router_logits:
                self._logits[l].append(logits.detach().reshape(-1, logits.shape[-1]).to("cpu", torch.float32))
            self._weights[l].append(weights.detach().to("cpu", torch.float32))
            if self.pregate:
                x = args[0] if args else kwargs["hidden_states"]
                self._pre[l].append(self._pregate(l, x.detach().reshape(-1, x.shape[-1])))

        return hook

    @torch.no_grad()
    def _pregate(self, l: int, x: torch.Tensor) -> torch.Tensor:
        L, E = len(self.layers), self.layers[0].num_experts
        out = torch.full((x.shape[0], self.pregate, E), float("nan"), dtype=torch.float16)
        for h in range(1, self.pregate + 1):
            if l + h < L:
                router = self.layers[l + h].router
                device = next(router.parameters()).device
                # .forward, not __call__: the later router's own recording hook must not fire.
                logits, _, _ = unpack_router_output(router, router.forward(x.to(device)))
                out[:, h - 1] = logits.float().cpu().to(torch.float16)
        return out

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(ids [N, L, K] int16, weights [N, L, K] float32, pregate [N, L, H, E] float16 or None,
        router logits [N, L, E] float32 or None) for the N positions seen since the last `take()`;
        then forget them."""
        counts = [sum(len(c) for c in chunks) for chunks in self._ids]
        if len(set(counts)) != 1 or counts[0] == 0:
            self._reset()
            raise UserError(
                f"router hooks saw {counts} positions in the MoE layers; a fused MoE kernel may bypass the "
                "router modules: load the model without hub kernels (e.g. use_kernels=False)"
            )
        ids = torch.stack([torch.cat(c) for c in self._ids], dim=1).numpy()
        weights = torch.stack([torch.cat(c) for c in self._weights], dim=1).numpy()
        pre = torch.stack([torch.cat(c) for c in self._pre], dim=1).numpy() if self.pregate else None
        own = torch.stack([torch.cat(c) for c in self._logits], dim=1).numpy() if self.router_logits else None
        self._reset()
        return ids, weights, pre, own

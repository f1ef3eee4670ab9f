"""Find the MoE routers of a transformers causal LM and record what they choose, through forward hooks.

    layers = moe_layers(model)                 # one MoeLayer per MoE decoder layer, dense ones skipped
    with RouterRecorder(layers, pregate=2) as rec:
        model(input_ids)
        ids, weights, pregate = rec.take()     # [N, L, K], [N, L, K], [N, L, 2, E] for the N positions

In transformers v5 every MoE block we support calls a router module (`MixtralTopKRouter`,
`Qwen2MoeTopKRouter`, `Qwen3MoeTopKRouter`, `OlmoeTopKRouter`, `DeepseekV2TopkRouter`,
`DeepseekV3TopkRouter`, `GptOssTopKRouter`, and others built the same way) that returns
`(router_logits, top_k_weights, top_k_index)` over the flattened tokens, and then feeds exactly
those weights and indices to its experts. So the hooks record outputs 2 and 1 as the expert ids and
gate weights, in the router's output order: after softmax and renormalisation (Mixtral, OLMoE,
Qwen with `norm_topk_prob`), group-limited choice with `e_score_correction_bias` and
`routed_scaling_factor` (DeepSeek), softmax over the top-k logits (GPT-OSS). Shared experts are
not recorded. Hooks live on module instances only; transformers' classes are never patched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from seqmoe.errors import UserError

_ROUTER_NAME = re.compile(r"router$", re.IGNORECASE)


@dataclass(frozen=True)
class MoeLayer:
    """One MoE decoder layer: its index among all decoder layers and its router module."""

    layer_index: int
    """Index of the decoder layer in `model.model.layers` (dense layers count too)."""
    name: str
    """Qualified module name of the router, e.g. `model.layers.3.mlp.gate`."""
    router: torch.nn.Module
    num_experts: int
    top_k: int


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """(qualified name, ModuleList) of the model's decoder layers (`model.model.layers` and the like)."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers" and len(module):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        raise UserError(f"{type(model).__name__} has no `layers` list of decoder layers; not a supported causal LM")
    return best


def moe_layers(model: torch.nn.Module) -> list[MoeLayer]:
    """The MoE layers of `model` in depth order, each with its router; UserError if there are none."""
    prefix, layers = decoder_layers(model)
    found = []
    for i, layer in enumerate(layers):
        routers = [(n, m) for n, m in layer.named_modules() if n and _ROUTER_NAME.search(type(m).__name__)]
        # Keep the outermost router-named module (e.g. skip parts of a `...Router` that are themselves routers).
        routers = [(n, m) for n, m in routers if not any(n.startswith(o + ".") for o, _ in routers)]
        if len(routers) > 1:
            names = ", ".join(type(m).__name__ for _, m in routers)
            raise UserError(f"decoder layer {i} has several router modules ({names}); this model is not supported")
        if routers:
            name, router = routers[0]
            found.append(MoeLayer(i, f"{prefix}.{i}.{name}", router, _num_experts(router), _top_k(router)))
    if not found:
        raise UserError(
            f"{type(model).__name__} has no MoE layers (no router module in its {len(layers)} decoder layers); "
            "give a Mixture-of-Experts model (Mixtral, Qwen-MoE, OLMoE, DeepSeek, GPT-OSS, ...)"
        )
    shapes = {(m.num_experts, m.top_k) for m in found}
    if len(shapes) > 1:
        raise UserError(f"MoE layers differ in (experts, top-k): {sorted(shapes)}; seqmoe traces need one shape")
    return found


def _num_experts(router: torch.nn.Module) -> int:
    for attr in ("num_experts", "n_routed_experts", "num_local_experts"):
        if isinstance(getattr(router, attr, None), int):
            return getattr(router, attr)
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.ndim == 2:
        return weight.shape[0]
    raise UserError(f"cannot tell how many experts {type(router).__name__} routes to")


def _top_k(router: torch.nn.Module) -> int:
    for attr in ("top_k", "num_experts_per_tok"):
        if isinstance(getattr(router, attr, None), int):
            return getattr(router, attr)
    raise UserError(f"cannot tell the top-k of {type(router).__name__}")


def unpack_router_output(router: torch.nn.Module, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [N, E], weights [N, K], ids [N, K]) from a router's output; UserError for other shapes."""
    if isinstance(output, (tuple, list)) and len(output) == 3:
        logits, weights, ids = output
        if (
            isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.ndim == 2
            and isinstance(weights, torch.Tensor) and weights.shape == ids.shape
            and isinstance(logits, torch.Tensor) and logits.shape[0] == ids.shape[0]
        ):  # fmt: skip
            return logits, weights, ids
    raise UserError(
        f"router {type(router).__name__} does not return (logits, weights, indices) like MixtralTopKRouter; "
        "this architecture is not supported for trace collection"
    )


class RouterRecorder:
    """Forward hooks on the routers of `layers` that keep every position's routing until `take()`.

    Args:
        layers: from `moe_layers(model)`.
        pregate: H >= 0; when positive, also apply the routers of MoE layers l+1..l+H to the input
            of layer l's router (under no_grad, bypassing hooks) and keep their logits as float16.
    """

    def __init__(self, layers: list[MoeLayer], *, pregate: int = 0) -> None:
        if pregate < 0:
            raise UserError(f"pre-gating horizon must be >= 0, got {pregate}")
        self.layers = layers
        self.pregate = pregate
        self._handles: list = []
        self._reset()

    def _reset(self) -> None:
        self._ids: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._weights: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._pre: list[list[torch.Tensor]] = [[] for _ in self.layers]

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
            _, weights, ids = unpack_router_output(module, output)
            self._ids[l].append(ids.detach().to("cpu", torch.int16))
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

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(ids [N, L, K] int16, weights [N, L, K] float32, pregate [N, L, H, E] float16 or None)
        for the N positions seen since the last `take()`; then forget them."""
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
        self._reset()
        return ids, weights, pre

"""Find a transformers v5 MoE model's decoder layers, MoE blocks, routers and experts, by family.

    arch = model_arch(model)                 # UserError for a dense model or an unsupported layout
    arch.family.name, arch.num_experts, arch.top_k
    for m in arch.moe:                       # MoeLayer: layer_index, router, block, experts
        layout = arch.layout(m.experts)      # the experts' packed layout (runtime)
    logits, weights, ids = unpack_router_output(m.router, m.router(x))

A model whose `config.model_type` has an entry in `families.FAMILIES` is read by that entry's
paths. Any other model goes through the generic search, the conventions every v5 family shares:
the longest ModuleList named `layers`; in each decoder layer, the outermost module whose class name
ends in "Router" (the layer is dense without one); its parent is the MoE block, whose `experts`
module holds the routed experts as parameters stacked over E (a `down_proj` among them); E and K
are read from the router's attributes. Both `collect` and `runtime` take this knowledge from here.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

from seqmoe.arch.families import GENERIC, Family, family_for, supported
from seqmoe.arch.layout import ExpertLayout
from seqmoe.base.errors import UserError

_ROUTER_CLASS = re.compile(r"router$", re.IGNORECASE)
_HOW_TO_ADD = "see 'Adding a model architecture' in the README (src/seqmoe/arch/families.py)"


@dataclass(frozen=True)
class MoeLayer:
    """One MoE decoder layer: its index among all decoder layers, its router and its MoE block."""

    layer_index: int
    """Index of the decoder layer among all of them (dense layers count too)."""
    name: str
    """Qualified module name of the router, e.g. `model.layers.3.mlp.gate`."""
    router: torch.nn.Module
    num_experts: int
    top_k: int
    block: torch.nn.Module
    """The MoE block: calls the router, then the routed experts."""
    block_name: str
    """Qualified module name of the block, e.g. `model.layers.3.mlp`."""
    experts_attr: str = "experts"
    """The block's attribute that holds the routed experts module (the runtime swaps it)."""

    @property
    def experts(self) -> torch.nn.Module | None:
        """The block's routed experts module as it is now (an `OffloadedExperts` once offloaded)."""
        return getattr(self.block, self.experts_attr, None)


@dataclass(frozen=True)
class ModelArch:
    """What the adapter found in one model."""

    family: Family
    """The family entry used (`families.GENERIC` for the generic search)."""
    layers_name: str
    """Qualified name of the decoder layers' ModuleList."""
    decoder: torch.nn.ModuleList
    moe: tuple[MoeLayer, ...]
    """The MoE layers in depth order (dense layers skipped)."""

    @property
    def num_layers(self) -> int:
        """L: the MoE layers (what a trace of this model indexes)."""
        return len(self.moe)

    @property
    def num_experts(self) -> int:
        return self.moe[0].num_experts

    @property
    def top_k(self) -> int:
        return self.moe[0].top_k

    def param_names(self, experts: torch.nn.Module) -> tuple[str, ...]:
        """The stacked per-expert parameters of `experts` ([E, ...] each); UserError if they are not
        the family's (a parameter the runtime did not pack would be read with the wrong expert ids)."""
        E, kind, fam = self.num_experts, type(experts).__name__, self.family
        own = dict(experts.named_parameters(recurse=False))
        stacked = tuple(n for n, p in own.items() if p.ndim >= 2 and p.shape[0] == E)
        if fam is GENERIC:
            if not any(n.endswith("down_proj") for n in stacked):
                raise UserError(f"{kind} does not hold its {E} experts as stacked 3-D parameters (transformers v5 "
                                f"layout, e.g. MixtralExperts); the runtime supports {supported()}; {_HOW_TO_ADD}")
            return stacked
        if set(own) != set(fam.params) or set(stacked) != set(fam.params):
            found = ", ".join(f"{n} {tuple(p.shape)}" for n, p in own.items()) or "none"
            raise UserError(f"{kind} should hold the stacked parameters {', '.join(fam.params)} ([{E}, ...] each) "
                            f"of the {fam.name} family, but has: {found}; this transformers version lays it out "
                            f"differently: update the family's `params` ({_HOW_TO_ADD})")
        return fam.params

    def layout(self, experts: torch.nn.Module) -> ExpertLayout:
        """The packed layout of one layer's routed experts module (checked with `check_experts`)."""
        check_experts(experts)
        return ExpertLayout.of(experts, self.param_names(experts), self.family.in_out)


def model_arch(model: torch.nn.Module) -> ModelArch:
    """The adapter's view of `model`: its family's paths, or the generic search for an unknown model type.

    Raises:
        UserError: no MoE layer, several routers in a layer, layers of different (E, K), or a
            known family laid out unlike its entry.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = family_for(model_type)
    if family is not None:
        layers_name, decoder = _known_layers(model, family)
        found = _known_moe(decoder, layers_name, family)
    else:
        family = GENERIC
        layers_name, decoder = _generic_layers(model)
        found = _generic_moe(decoder, layers_name)
    if not found:
        raise UserError(
            f"{type(model).__name__} (model_type {model_type!r}) has no MoE layers (no router module in its "
            f"{len(decoder)} decoder layers); give a Mixture-of-Experts model of a supported family "
            f"({supported()}) or one laid out like them; {_HOW_TO_ADD}")
    shapes = {(m.num_experts, m.top_k) for m in found}
    if len(shapes) > 1:
        raise UserError(f"MoE layers differ in (experts, top-k): {sorted(shapes)}; seqmoe traces need one shape")
    return ModelArch(family, layers_name, decoder, tuple(found))


def moe_layers(model: torch.nn.Module) -> list[MoeLayer]:
    """The MoE layers of `model` in depth order, each with its router; UserError if there are none."""
    return list(model_arch(model).moe)


def _known_layers(model: torch.nn.Module, family: Family) -> tuple[str, torch.nn.ModuleList]:
    try:
        decoder = model.get_submodule(family.layers)
    except AttributeError:
        decoder = None
    if not isinstance(decoder, torch.nn.ModuleList) or not len(decoder):
        raise UserError(f"{type(model).__name__} of the {family.name} family has no decoder layers at "
                        f"`{family.layers}`; this transformers version lays it out differently ({_HOW_TO_ADD})")
    return family.layers, decoder


def _known_moe(decoder: torch.nn.ModuleList, prefix: str, family: Family) -> list[MoeLayer]:
    found = []
    for i, layer in enumerate(decoder):
        block = getattr(layer, family.block, None)
        router = getattr(block, family.router, None)
        if not isinstance(router, torch.nn.Module):
            continue  # a dense layer
        if not isinstance(getattr(block, family.experts, None), torch.nn.Module):
            raise UserError(f"{type(block).__name__} in decoder layer {i} has a router but no `{family.experts}` "
                            f"module; this transformers version lays {family.name} out differently ({_HOW_TO_ADD})")
        block_name = f"{prefix}.{i}.{family.block}"
        try:
            E = _int_attr(router, (family.num_experts,), "number of experts")
            K = _int_attr(router, (family.top_k,), "top-k")
        except UserError as e:  # e.g. DeepSeek's gate was a plain Linear before transformers 5.13
            raise UserError(f"{e}; the installed transformers lays {family.name} out differently from seqmoe's entry: "
                            "upgrade transformers (seqmoe's `hf` extra says which)") from None
        found.append(MoeLayer(i, f"{block_name}.{family.router}", router, E, K, block, block_name, family.experts))
    return found


def _generic_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    best = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers" and len(module):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        raise UserError(f"{type(model).__name__} has no `layers` list of decoder layers; not a supported causal LM "
                        f"(supported families: {supported()})")
    return best


def _generic_moe(decoder: torch.nn.ModuleList, prefix: str) -> list[MoeLayer]:
    found = []
    for i, layer in enumerate(decoder):
        routers = [(n, m) for n, m in layer.named_modules() if n and _ROUTER_CLASS.search(type(m).__name__)]
        # The outermost router-named module (parts of a `...Router` may be routers themselves).
        routers = [(n, m) for n, m in routers if not any(n.startswith(o + ".") for o, _ in routers)]
        if len(routers) > 1:
            names = ", ".join(type(m).__name__ for _, m in routers)
            raise UserError(f"decoder layer {i} has several router modules ({names}); this model is not supported "
                            f"(supported families: {supported()})")
        if routers:
            name, router = routers[0]
            block_name = name.rpartition(".")[0]
            block = layer.get_submodule(block_name) if block_name else layer
            E = _int_attr(router, ("num_experts", "n_routed_experts", "num_local_experts"), "number of experts",
                          weight_rows=True)
            K = _int_attr(router, ("top_k", "num_experts_per_tok"), "top-k")
            full = f"{prefix}.{i}" + (f".{block_name}" if block_name else "")
            found.append(MoeLayer(i, f"{prefix}.{i}.{name}", router, E, K, block, full))
    return found


def _int_attr(router: torch.nn.Module, attrs: tuple[str, ...], what: str, weight_rows: bool = False) -> int:
    """The first integer attribute of `attrs` on `router` (or, with `weight_rows`, its [E, H] weight's rows)."""
    for attr in attrs:
        if isinstance(getattr(router, attr, None), int):
            return getattr(router, attr)
    weight = getattr(router, "weight", None)
    if weight_rows and isinstance(weight, torch.Tensor) and weight.ndim == 2:
        return weight.shape[0]
    raise UserError(f"{type(router).__name__} has no integer {' or '.join(attrs)} attribute; cannot tell its "
                    f"{what} ({_HOW_TO_ADD})")


def check_experts(experts: torch.nn.Module) -> None:
    """UserError unless `experts` is a v5 experts module the runtime can wrap: an integer
    `num_experts` and a forward taking (hidden_states, top_k_index, top_k_weights)."""
    kind = type(experts).__name__
    if not isinstance(experts.__dict__.get("num_experts"), int):
        raise UserError(f"{kind} has no integer `num_experts` attribute; this architecture is not supported by the "
                        f"runtime ({_HOW_TO_ADD})")
    if len(inspect.signature(experts.forward).parameters) < 3:
        raise UserError(f"{kind}.forward does not take (hidden_states, indices, weights); not supported by the runtime")


def experts_implementation(experts: torch.nn.Module) -> str | None:
    """The transformers experts implementation (`config._experts_implementation`: "eager",
    "grouped_mm", "batched_mm", ...) `experts` dispatches through, or None when its forward is its
    own (only modules decorated with `use_experts_implementation` dispatch; they carry `has_gate`)."""
    if not hasattr(experts, "has_gate"):
        return None
    return getattr(getattr(experts, "config", None), "_experts_implementation", None)


def unpack_router_output(router: torch.nn.Module, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [N, E], weights [N, K], ids [N, K]) from a router's output; UserError for other shapes.

    Every v5 router returns them in this order over the flattened tokens, after its own scoring
    (softmax and renormalisation, DeepSeek's group-limited choice and scaling, GPT-OSS's softmax over
    the top-k logits), and its block feeds exactly these weights and ids to its experts."""
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
        f"this architecture is not supported (supported families: {supported()})"
    )

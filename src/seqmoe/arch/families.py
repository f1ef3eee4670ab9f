"""The MoE model families seqmoe knows, one `Family` each: the one file to touch to add an architecture.

    family = family_for("deepseek_v3")       # by transformers' config.model_type; None: unknown
    family.router, family.params             # "gate", ("gate_up_proj", "down_proj")

A family says where a transformers v5 causal LM keeps its MoE parts: the decoder layers (a
ModuleList), the MoE block in each layer, the block's router and routed experts modules, the
router attributes that give E and K, and the experts module's stacked per-expert parameters (each
[E, ...]; the runtime packs one expert's slice of every one of them into one row). A decoder layer
is a MoE layer when its block has the router attribute (dense layers hold a plain MLP there).

The runtime never interprets a parameter's layout: it moves each expert's slice as is and runs the
original experts forward on it, so transposed or interleaved layouts (GPT-OSS) only need their
parameters named here. Models of an unknown `model_type` go through the generic search in
`adapter` (the same v5 conventions found by name), so a new v5 MoE family often works unlisted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Family:
    """Where one transformers v5 MoE family keeps its layers, router, experts and expert weights."""

    name: str
    """Short name, shown in errors and recorded with traces."""
    model_types: tuple[str, ...]
    """transformers `config.model_type` values served by this entry."""
    layers: str = "model.layers"
    """Path from the *ForCausalLM to the ModuleList of decoder layers."""
    block: str = "mlp"
    """Attribute of a decoder layer that holds its MoE block (or, in a dense layer, its MLP)."""
    router: str = "gate"
    """Attribute of the MoE block that holds its router (returns (logits [N, E], weights [N, K], ids [N, K]))."""
    experts: str = "experts"
    """Attribute of the MoE block that holds its routed experts module (shared experts stay put)."""
    num_experts: str = "num_experts"
    """Integer attribute of the router: E, the routed experts."""
    top_k: str = "top_k"
    """Integer attribute of the router: K, the experts each token is routed to."""
    params: tuple[str, ...] = ("gate_up_proj", "down_proj")
    """The experts module's parameters, each stacked over the E experts ([E, ...]); it may have no others."""
    in_out: bool = False
    """Whether the experts' matrices are [inputs, outputs] (a linear's weight transposed)."""
    note: str = ""
    """What is particular about the family (dense layers, shared experts, layouts)."""


FAMILIES: tuple[Family, ...] = (
    Family(name="mixtral", model_types=("mixtral",)),
    Family(name="qwen2_moe", model_types=("qwen2_moe",),
           note="dense layers (mlp_only_layers, decoder_sparse_step) hold an MLP without `gate`; the gated shared "
                "expert stays on the device"),
    Family(name="qwen3_moe", model_types=("qwen3_moe",)),
    Family(name="olmoe", model_types=("olmoe",), note="also seqmoe-tiny (its config.json says model_type olmoe)"),
    Family(name="deepseek_v2", model_types=("deepseek_v2",),
           note="the first `first_k_dense_replace` layers are dense; shared_experts stay on the device"),
    Family(name="deepseek_v3", model_types=("deepseek_v3",),
           note="as deepseek_v2; the router's e_score_correction_bias is a buffer of the router, not an expert"),
    Family(name="gpt_oss", model_types=("gpt_oss",), router="router",
           params=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), in_out=True,
           note="gate_up_proj is [E, H, 2I], transposed, gate and up interleaved; per-expert biases"),
)
"""Every family with its own entry, in the order errors list them."""

GENERIC = Family(name="generic", model_types=(), layers="", block="", router="", params=())
"""The fallback for unknown model types: layers, routers and stacked parameters found by name (`adapter`)."""


def family_for(model_type: str | None) -> Family | None:
    """The entry of FAMILIES that serves `model_type`, or None."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def supported() -> str:
    """The supported families, for error messages."""
    return ", ".join(f.name for f in FAMILIES)

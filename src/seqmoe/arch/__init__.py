"""How transformers v5 MoE models are laid out: one adapter that `collect` and `runtime` both read.

    from seqmoe.arch import model_arch
    arch = model_arch(model)        # family, decoder layers, MoE layers (router, block, experts), E, K
    arch.layout(arch.moe[0].experts)   # the routed experts' packed layout

`families` lists the supported families (add an architecture there), `adapter` finds their parts
(with a generic search for unknown model types), `layout` packs one expert into one row, `calls`
passes the KV cache under the name the installed transformers takes.
"""

from seqmoe.arch.adapter import (ModelArch, MoeLayer, check_experts, experts_implementation, model_arch, moe_layers,
                                 unpack_router_output)
from seqmoe.arch.calls import cache_kwarg, output_cache
from seqmoe.arch.families import FAMILIES, GENERIC, Family, family_for
from seqmoe.arch.layout import ExpertLayout

__all__ = ["ModelArch", "MoeLayer", "model_arch", "moe_layers", "unpack_router_output", "check_experts",
           "experts_implementation", "cache_kwarg", "output_cache", "Family", "FAMILIES", "GENERIC", "family_for", "ExpertLayout"]

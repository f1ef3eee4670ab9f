"""Transformers models: how v5 MoE models are laid out (one adapter that `collect` and the runtime both
read), how model folders are found and loaded, how their routing is recorded, and seqmoe-tiny.

    from seqmoe.arch import model_arch
    arch = model_arch(model)        # family, decoder layers, MoE layers (router, block, experts), E, K
    arch.layout(arch.moe[0].experts)   # the routed experts' packed layout

`families` lists the supported families (add an architecture there), `adapter` finds their parts
(with a generic search for unknown model types), `layout` packs one expert into one row, `calls`
passes the KV cache under the name the installed transformers takes, `quant` the quantized layouts,
`published` published architectures' shapes; `model_dirs` finds model folders (no torch),
`collect/` loads models and records their routing, `tiny/` trains seqmoe-tiny. Imports `base`,
`costs` and `trace`.

The adapters need torch; `model_dirs` does not, so this package imports its modules on first use:
a command checks its model argument before torch loads.
"""

from seqmoe.base.lazy import lazy_exports

_HOMES = {
    "adapter": ("ModelArch", "MoeLayer", "model_arch", "moe_layers", "unpack_router_output", "check_experts",
                "experts_implementation"),
    "calls": ("cache_kwarg", "output_cache"),
    "families": ("FAMILIES", "GENERIC", "Family", "family_for"),
    "layout": ("ExpertLayout",),
}
__all__ = [name for names in _HOMES.values() for name in names]
__getattr__ = lazy_exports(__name__, _HOMES)

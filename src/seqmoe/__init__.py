"""seqmoe: keep the right MoE experts resident before each layer needs them.

    trace ──► predict ──► schedule ──► cache ──► runtime | sim
    (who used   (what next,  (which copies,  (who is     (real model |
     what)       how likely)  by when)        evicted)    cost-model replay)
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`seqmoe.offload`, `seqmoe.load` and `seqmoe.quantize_experts` import the runtime (and torch) on
    first use only."""
    if name == "offload":
        from seqmoe.runtime import offload

        return offload
    if name == "load":
        from seqmoe.runtime.load import load

        return load
    if name == "quantize_experts":
        from seqmoe.arch.quant import quantize_experts

        return quantize_experts
    raise AttributeError(f"module 'seqmoe' has no attribute {name!r}")

"""seqmoe: keep the right MoE experts resident before each layer needs them.

    trace ──► predict ──► schedule ──► cache ──► runtime | sim
    (who used   (what next,  (which copies,  (who is     (real model |
     what)       how likely)  by when)        evicted)    cost-model replay)
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`seqmoe.offload` imports the runtime (and torch) on first use only."""
    if name == "offload":
        from seqmoe.runtime import offload

        return offload
    raise AttributeError(f"module 'seqmoe' has no attribute {name!r}")

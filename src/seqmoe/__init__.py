"""seqmoe: keep the right MoE experts resident before each layer needs them.

    trace ──► predict ──► schedule ──► cache ──► runtime | sim
    (who used   (what next,  (which copies,  (who is     (real model |
     what)       how likely)  by when)        evicted)    cost-model replay)
"""

__version__ = "0.1.0"

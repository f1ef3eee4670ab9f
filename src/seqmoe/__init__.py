"""seqmoe: keep the right MoE experts resident before each layer needs them.

    trace ──► brain ──┬──► sim       a trace replayed on the cost model
                      └──► runtime   a real model ──► serve (the OpenAI API)

    brain:  predict (what next) ─► schedule (which copies, by when) ─► policies (who is evicted)
            ─► manager (the slots, the copy channel, the miss paths, the clock: one state machine)
    costs:  what a model and a machine cost (the simulator and the runtime's clock price by it)
    arch:   transformers models (family adapters, packed expert layouts, loading, recording traces)

The planes, downhill (each imports only those before it): `base` (errors, files) ► `trace`,
`costs` ► `arch`, `brain` ► `config` ► `sim`, `runtime` ► `serve` ► `cli`.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`seqmoe.offload`, `seqmoe.load`, `seqmoe.convert` and `seqmoe.quantize_experts` import the runtime
    (and torch) on first use only."""
    if name == "offload":
        from seqmoe.runtime import offload  # numba, torch: only when this runs

        return offload
    if name == "load":
        from seqmoe.runtime.load import load  # numba, torch: only when this runs

        return load
    if name == "convert":
        from seqmoe.runtime.disk.convert import convert  # torch: only when this runs

        return convert
    if name == "quantize_experts":
        from seqmoe.arch.quant import quantize_experts  # torch: only when this runs

        return quantize_experts
    raise AttributeError(f"module 'seqmoe' has no attribute {name!r}")

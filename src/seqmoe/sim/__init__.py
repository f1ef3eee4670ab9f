"""The trace-driven simulator: a recorded trace replayed through the memory manager on the cost model.

    counts = simulate(trace, system, model=..., hardware=..., capacity=C, start=start)   # one replay
    rows = run_sweep(SimConfig(...), systems, residencies)                              # sim.run

`replay` drives the brain's manager over a trace, `run` turns configurations into result rows,
`lockstep` and `prefill` are the batch and prompt extensions of the protocol, `ray_sweep` runs a
sweep as Ray tasks, `report/` writes tables, JSONL and plots. Imports `base`, `trace`, `costs`,
`brain` and `config`; never the runtime.
"""

from seqmoe.sim.replay import simulate

__all__ = ["simulate"]

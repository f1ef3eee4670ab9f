"""The trace-driven simulator: a recorded trace replayed through the memory manager on the cost model.

    counts = simulate(trace, system, model=..., hardware=..., capacity=C, start=start)   # one replay
    rows = run_sweep(SimConfig(...), systems, residencies)                              # sim.run
"""

from seqmoe.sim.replay import simulate

__all__ = ["simulate"]

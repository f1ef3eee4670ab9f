"""The memory manager compiled (numba) over preallocated arrays, for the systems on the hot path.

`CompiledManager` runs the same decisions as `seqmoe.brain.manager.state.MemoryManager` for systems made
of an LRU or forecast (probabilistic Belady) eviction policy, no scheduler or the deadline
scheduler, any predictor whose forecasts span at most 2 L positions, and every miss path but
`cpu-all`'s (`seqmoe.brain.manager.miss_paths`); `compile_blocker(system)` says why a system does not qualify (None: it does). `seqmoe.brain.manager.build_manager` picks it when it can.
"""

from seqmoe.brain.manager.compiled._build_dir import use_build_dir

with use_build_dir():
    from seqmoe.brain.manager.compiled.manager import CompiledManager, compilable, compile_blocker

__all__ = ["CompiledManager", "compilable", "compile_blocker"]

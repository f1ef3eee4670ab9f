"""Which state machine runs a system: the compiled one when its parts have kernels, else the
reference, which says so (`ReferenceManagerWarning`, `manager_kind`)."""

from __future__ import annotations

import warnings

from seqmoe.brain.manager.base import PoolObserver, ReferenceManagerWarning, System
from seqmoe.brain.manager.compiled import CompiledManager, compile_blocker
from seqmoe.brain.manager.state import MemoryManager


def manager_kind(system: System, compiled: bool = True) -> dict:
    """Which manager runs `system`: {"manager": "compiled"}, or {"manager": "reference",
    "manager_reason": why} (`stats()["manager"]`, and a replay's row)."""
    why = compile_blocker(system) if compiled else "the compiled manager was turned off (compiled=False)"
    return {"manager": "compiled"} if why is None else {"manager": "reference", "manager_reason": why}


def build_manager(system: System, *, model, hardware, capacity: int, start, observer: PoolObserver | None = None,
                  on_forecast=None, compiled: bool = True):
    """The state machine that runs `system` over `capacity` slots from the `start` placement: the
    compiled one when the system qualifies (`compile_blocker`) and `compiled`, else the reference
    `MemoryManager`. Both make the same decisions; a system that could not run compiled is reported
    (`ReferenceManagerWarning`), never silently slower."""
    kind = manager_kind(system, compiled)
    if kind["manager"] == "reference" and compiled:
        warnings.warn(f"system {system.name!r} runs on the reference manager (Python; the same decisions, slower): "
                      f"{kind['manager_reason']}", ReferenceManagerWarning, stacklevel=2)
    cls = CompiledManager if kind["manager"] == "compiled" else MemoryManager
    return cls(system, model=model, hardware=hardware, capacity=capacity, start=start, observer=observer,
               on_forecast=on_forecast)

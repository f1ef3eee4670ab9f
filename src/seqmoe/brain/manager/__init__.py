"""The memory manager: which experts hold the device slots, decided one position at a time.

One state machine, driven the same way by the simulator (over a recorded trace) and by the
runtime's control plane (over a live model's routers):

    system = build_system("seqmoe", SystemInputs(train=train, test=test, capacity=C, start=start, predictor=p))
    driver = Driver(build_manager(system, model=model_profile, hardware=hw, capacity=C, start=start))
    driver.token_start(token_id, new_request); driver.reveal(layer, ids); driver.layer_end(layer)
    summarize(driver.finish(), expert_bytes=model_profile.expert_bytes)

Parts: `state` (the state machine and its `System` of policy, predictor and scheduler), `channel`
(the copy channel), `driver` (the clock and the call order), `placement` (capacity, start
placement, the checks of the inputs), `counts` (counts and the metric summary), `systems` (the
named systems and what each declares).
"""

import warnings

from seqmoe.brain.manager.base import PoolObserver, System
from seqmoe.brain.manager.compiled import CompiledManager, compile_blocker
from seqmoe.brain.manager.counts import SimCounts, summarize
from seqmoe.brain.manager.driver import Driver
from seqmoe.brain.manager.placement import capacity_for, check_capacity, check_residency, start_placement
from seqmoe.brain.manager.state import MemoryManager
from seqmoe.brain.manager.systems import SYSTEMS, SystemInputs, SystemSpec, build_system, system_spec


class ReferenceManagerWarning(UserWarning):
    """A system runs on the reference manager (Python): the same decisions and counts as compiled,
    at a higher cost per decision."""


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


__all__ = ["ReferenceManagerWarning", "manager_kind", "Driver", "MemoryManager", "PoolObserver", "System", "SimCounts", "summarize", "SYSTEMS", "SystemInputs",
           "SystemSpec", "build_manager", "build_system", "system_spec", "capacity_for", "check_capacity",
           "check_residency", "start_placement"]

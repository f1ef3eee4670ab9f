"""The memory manager: which experts hold the device slots, decided one position at a time.

One state machine, driven the same way by the simulator (over a recorded trace) and by the
runtime's control plane (over a live model's routers):

    system = build_system("seqmoe", SystemInputs(train=train, test=test, capacity=C, start=start, predictor=p))
    driver = Driver(build_manager(system, model=model_profile, hardware=hw, capacity=C, start=start))
    driver.token_start(token_id, new_request); driver.reveal(layer, ids); driver.layer_end(layer)
    summarize(driver.finish(), expert_bytes=model_profile.expert_bytes)

Parts: `state` (the state machine and its `System` of policy, predictor and scheduler), `engine`
(the copy channel), `driver` (the clock and the call order), `placement` (capacity, start
placement, the checks of the inputs), `counts` (counts and the metric summary), `systems` (the
named systems and what each declares).
"""

from seqmoe.brain.manager.counts import SimCounts, summarize
from seqmoe.brain.manager.driver import Driver
from seqmoe.brain.manager.placement import capacity_for, check_capacity, check_residency, start_placement
from seqmoe.brain.manager.base import PoolObserver, System
from seqmoe.brain.manager.state import MemoryManager
from seqmoe.brain.manager.systems import SYSTEMS, SystemInputs, SystemSpec, build_system, system_spec


def build_manager(system: System, *, model, hardware, capacity: int, start, observer: PoolObserver | None = None,
                  compiled: bool = True):
    """The state machine that runs `system` over `capacity` slots from the `start` placement: the
    compiled one when the system qualifies (`compilable`) and `compiled`, else the reference
    `MemoryManager`. Both make the same decisions."""
    from seqmoe.brain.manager.compiled import CompiledManager, compilable

    cls = CompiledManager if compiled and compilable(system) else MemoryManager
    return cls(system, model=model, hardware=hardware, capacity=capacity, start=start, observer=observer)


__all__ = ["Driver", "MemoryManager", "PoolObserver", "System", "SimCounts", "summarize", "SYSTEMS", "SystemInputs",
           "SystemSpec", "build_manager", "build_system", "system_spec", "capacity_for", "check_capacity",
           "check_residency", "start_placement"]

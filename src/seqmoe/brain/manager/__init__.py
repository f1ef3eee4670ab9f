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
named systems and what each declares; `registry`, the mechanism they register with), `build` (which
state machine runs a system). The names below are imported on first use: `seqmoe.config` reads the
miss paths, placement checks and system specs without numba.
"""

from seqmoe.base.lazy import lazy_exports

_HOMES = {
    "build": ("build_manager", "manager_kind"),
    "base": ("PoolObserver", "ReferenceManagerWarning", "System"),
    "counts": ("SimCounts", "summarize"),
    "driver": ("Driver",),
    "placement": ("capacity_for", "check_capacity", "check_residency", "start_placement"),
    "state": ("MemoryManager",),
    "systems": ("SYSTEMS", "SystemInputs", "SystemSpec", "build_system", "system_spec"),
}
__all__ = [name for names in _HOMES.values() for name in names]
__getattr__ = lazy_exports(__name__, _HOMES)

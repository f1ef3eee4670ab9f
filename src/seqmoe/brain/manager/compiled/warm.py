"""Load the compiled kernels before anything is timed.

numba loads a cached kernel at its first call (a tenth of a second or more each, longer the first
time it compiles); counted in a run's decision time, that one-time cost would read as hundreds of
microseconds per token over a thousand-token replay. `warm_up()` drives a tiny manager of every
compiled kind through two tokens once per process, with the argument types real runs pass.
"""

from __future__ import annotations

import numpy as np

from seqmoe.brain.manager.base import System
from seqmoe.brain.manager.driver import Driver
from seqmoe.brain.policies.forecast import ForecastPolicy
from seqmoe.brain.policies.lru import LRUPolicy
from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.costs.profiles import HardwareProfile, ModelProfile
from seqmoe.brain.schedule.deadline import DeadlinePrefetcher

_L, _E, _K = 2, 4, 2


class _Steady(Predictor):
    """A forecaster that always expects the same experts (float32 rows, as the real ones give)."""

    horizon = 2 * _L

    def begin_request(self) -> None:
        pass

    def begin_token(self, step: int, token_id) -> None:
        pass

    def observe(self, step: int, ids) -> None:
        pass

    def predict(self, step: int) -> Forecast:
        first = step + 1
        probs = np.full((2 * _L - first % _L, _E), 0.5, dtype=np.float32)
        return Forecast(np.arange(first, first + len(probs), dtype=np.int64), probs)


_done = [False]


def warm_up(manager_cls) -> None:
    """Call every kernel a compiled manager (of class `manager_cls`) calls, once per process (the
    managers built here come back to this call and return at once)."""
    if _done[0]:
        return
    _done[0] = True

    model = ModelProfile(name="warm-up", num_layers=_L, num_experts=_E, top_k=_K, expert_bytes=1 << 20)
    hw = HardwareProfile(name="warm-up", h2d_bytes_per_s=1e9, hbm_bytes_per_s=1e12, device_memory_bytes=1 << 30)
    policy = ForecastPolicy(np.full(_L * _E, 0.5), num_layers=_L, num_experts=_E)
    systems = (System("lru", LRUPolicy()), System("forecast", policy, _Steady(), DeadlinePrefetcher(policy)))
    ids = np.array([[0, 1], [2, 3]], dtype=np.int16)
    for system in systems:
        driver = Driver(manager_cls(system, model=model, hardware=hw, capacity=_K + 1, start=[0]))
        for t in range(2):
            driver.token_start(None, t == 0)
            for layer in range(_L):
                driver.reveal(layer, ids[(t + layer) % 2])
                driver.layer_end(layer)
        driver.finish()

"""The registry of named systems: what a system declares (`SystemSpec`), what it may read
(`SystemInputs`), registration, the lists drawn from the declarations, and building one by name. The
systems themselves register in `seqmoe.brain.manager.systems`, which every caller imports (importing it
is what fills the registry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.brain.manager.base import System
from seqmoe.brain.manager.miss_paths import Twin, check_miss
from seqmoe.brain.predict.base import Predictor
from seqmoe.trace.schema import RoutingTrace

ROLES = ("baseline", "host", "seqmoe", "ablation", "oracle")
"""What a system is: a realisable baseline, a reference that computes experts on the host CPU (it needs
a hardware profile with a host), the seqmoe system, an ablation of it, or an oracle (an upper bound)."""


@dataclass(frozen=True, kw_only=True)
class SystemInputs:
    """What a system may learn from (train) or, for oracles only, look ahead into (test)."""

    train: RoutingTrace
    """Training split: statistics, matrices, learned predictors."""
    test: RoutingTrace
    """The trace being replayed; only oracles may read it."""
    capacity: int
    """C, slots in the pool."""
    start: tuple[int, ...]
    """The start placement every system shares."""
    predictor: object | None = None
    """The seqmoe systems' forecaster: a trained `SeqPredictor` (`seqmoe.brain.predict.provide.seq_predictor_for`)
    or an `OnlineForecaster` (`seqmoe.brain.predict.online`)."""
    prior: tuple | None = None
    """Online: the seqmoe systems' prior beyond the forecast, (use rates [L * E], `ReuseTable` or None),
    in place of the training trace's (`seqmoe.brain.predict.online.cold_prior`); None: learned from `train`."""
    draft: str = "none"
    """The seqmoe systems' drafter of the next tokens (`seqmoe.brain.predict.drafters.DRAFTERS`)."""
    visits: np.ndarray | None = None
    """[S, L, W] global ids of the positions the replay visits when they are not `test`'s own (a batched
    replay, `seqmoe.sim.lockstep`): where oracles read the future."""
    predictions: object | None = None
    """Predictions made elsewhere (`seqmoe.brain.predict.baselines.external.ExternalPredictor`) for the systems
    that replay them; None: none given, or none usable (lead 0 on a priced link)."""
    pregate: object | None = None
    """Pre-gate rows computed live (`seqmoe.runtime.eager.pregate.LivePregate`), in place of `test`'s recorded ones."""


@dataclass(frozen=True)
class SystemSpec:
    name: str
    summary: str
    build: Callable[[SystemInputs], System]
    role: str
    """One of `ROLES`."""
    needs_predictor: bool
    """Needs a trained seq2seq forecaster (`SystemInputs.predictor`)."""
    learns: bool
    """Learns from the training trace (statistics, start placement); the runtime then needs `train=`."""
    forecaster: Callable[[RoutingTrace, int], Predictor] | None = None
    """`forecaster(train, horizon)`: the system's own expert forecast, for `seqmoe eval-predictor`."""
    needs_pregate: bool = False
    """Needs traces with pre-gate scores (`--pregate`), so left out of the default system lists; live,
    it needs a training trace collected with them (the runtime computes the pre-gate itself)."""
    miss: str | None = None
    """The miss rule the system always takes (a name of `seqmoe.brain.manager.miss_paths.MISS_RULES`);
    None: the run's `miss` setting."""
    needs_predictions: bool = False
    """Replays predictions made elsewhere (`SimConfig.predictions`), so it runs only in a replay given them."""

    @property
    def reads_future(self) -> bool:
        """An oracle: reads the replayed trace's future, so it cannot run live."""
        return self.role == "oracle"


SYSTEMS: dict[str, SystemSpec] = {}


def register_system(name: str, summary: str, *, role: str = "baseline", needs_predictor: bool = False,
                    learns: bool = True, forecaster: Callable[[RoutingTrace, int], Predictor] | None = None,
                    needs_pregate: bool = False, miss: str | None = None, needs_predictions: bool = False):
    """Decorator: register `fn(inputs) -> System` under `name`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")

    def deco(fn):
        SYSTEMS[name] = SystemSpec(name, summary, fn, role, needs_predictor, learns, forecaster, needs_pregate, miss,
                                   needs_predictions)
        return fn

    return deco


def system_spec(name: str, choices=None) -> SystemSpec:
    """The spec of system `name`; UserError naming the `choices` (default: every system) if unknown."""
    if name not in SYSTEMS:
        raise UserError(f"unknown system {name!r}; choose one of: {', '.join(choices or SYSTEMS)}")
    return SYSTEMS[name]


def systems_with(*roles: str, with_pregate: bool = False) -> list[str]:
    """The systems of the given roles, in registration order (those needing pre-gate scores only
    if `with_pregate`)."""
    return [n for n, spec in SYSTEMS.items() if spec.role in roles and (with_pregate or not spec.needs_pregate)
            and not spec.needs_predictions]


def oracles() -> list[str]:
    """The systems that read the future of the trace (upper bounds, not realisable)."""
    return systems_with("oracle")


def baselines(with_pregate: bool = False) -> list[str]:
    """The systems that need no trained forecaster, serve misses as the run says (the host references
    are left out) and need no pre-gate scores unless `with_pregate`; none that replays external predictions."""
    return [n for n, spec in SYSTEMS.items() if not spec.needs_predictor and spec.role != "host"
            and (with_pregate or not spec.needs_pregate) and not spec.needs_predictions]


def live_systems(with_train: bool = True, with_predictor: bool = False, with_host: bool = False,
                 with_pregate: bool = False) -> list[str]:
    """Systems that can run live (no oracle): those that need a training trace only if `with_train`,
    those that need the seq2seq forecaster only if `with_predictor`, the host references (they need a
    hardware profile with a host and inline control) only if `with_host`, those that need pre-gate
    scores (a training trace collected with them, inline control) only if `with_pregate`."""
    return [n for n, s in SYSTEMS.items() if not s.reads_future and (with_predictor or not s.needs_predictor)
            and (with_train or not s.learns) and (with_pregate or not s.needs_pregate)
            and (with_host or s.role != "host") and not s.needs_predictions]


def build_system(name: str, inputs: SystemInputs, miss: str = "copy", twin: Twin | None = None) -> System:
    """A fresh system by name (UserError naming the choices if unknown), serving its misses by
    `miss` unless it fixes its own path (`SystemSpec.miss`), and by `twin` where it says."""
    spec = system_spec(name)
    return dataclasses.replace(spec.build(inputs), miss=spec.miss or check_miss(miss), twin=twin)


def check_live_system(system: str, *, train: bool, predictor: bool, replay: bool = False) -> None:
    """UserError unless `system` can run live with what is given: a training trace (`train`), a trained
    forecaster (`predictor`), the routing a harness forces (`replay`: oracles may read its future)."""
    live = live_systems(with_predictor=True, with_host=True, with_pregate=True)
    spec = system_spec(system, live)
    if spec.reads_future and not replay:
        raise UserError(f"system {system!r} reads the future of the trace and cannot run live; choose one of: "
                        f"{', '.join(live)}")
    if spec.needs_pregate and not (predictor or train):
        raise UserError(f"system {system!r} needs the seq2seq forecaster: pass predictor= (--predictor DIR: a "
                        "checkpoint of `seqmoe train` on a trace of this model), or train= (--train TRACE) to train "
                        "one on")
    # The other seqmoe systems learn their forecaster online without a predictor or a trace.
    if ((spec.learns and not spec.needs_predictor) or spec.needs_pregate) and not train:
        raise UserError(f"system {system!r} learns from a routing trace of this model: pass train= (--train TRACE, "
                        "from `seqmoe trace collect`), or choose one of: " + ", ".join(live_systems(with_train=False)))

"""Three ways to serve a miss, and the bound on time that holds whichever a system takes.

A miss (an expert neither resident nor on its way) is served by
- `copy`: a demand copy into a slot (evicting a victim), as the protocol always did;
- `in-place`: the layer reads the host row over the link: the same bytes, no slot, no eviction;
- `cpu`: the host CPU computes the expert from its host copy; only activations cross the link.
`auto` picks per miss: the path that finishes first (the link behind its queued demands, or the
CPU behind the experts it already has), and on the link a copy only when the expert is worth its
slot (its keep value above the victim's, for policies that value experts), else an in-place read;
an expert served on the CPU while the link is idle and worth its slot is also copied in behind
(a prefetch due at its layer of the next token).

Each path is a `MissPath` object that says what it does (takes a slot, runs on the host CPU, reads a
twin), and each option a `MissRule` (a fixed path, or `auto`); they carry the compiled manager's
codes. This is the only module that reads their names: add a path here, its kernel in
`compiled/miss_paths.py`, and what the observers do with it (`PoolObserver.on_off_pool`).

Beside them, off by default, a low-bit twin (`Twin`; HOBBIT's mixed-precision loading is the
anchor): every expert may also keep a copy at a lower precision in host memory, and a miss whose
gate weight is small is served by reading its twin over the link for this one activation (fewer
bytes than any path above that crosses the link; no slot, no eviction, so no later hit carries the
twin's error). Each token has `Twin.budget` of gate weight to spend over its MoE layers; at each
layer its misses are taken cheapest first (smallest gate weight) while the token's budget holds
(`pick_twins`), as cache-aware routing spends its KL budget. Where misses may go to the host CPU
(`miss` cpu or auto) a miss so taken still goes there when the CPU would finish it before its twin
read (`twin_waits_for_cpu`: the CPU's answer is exact), and its weight stays unspent. The bound
below assumes full-size transfers, so a run with twins reports none.

The bound on time (`paths_bound_time_s`; stated in docs/DESIGN.md, "Bound with miss paths"):
    bound = min over m_c = 0..A of max(F0 + e (A - m_c), c ceil(R / 2), h m_c),  R = max(0, N_opt - 2 m_c)
Why it holds: docs/decode.md, "The miss paths and their bound".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.costs.precision import GROUP, PRECISIONS, quantized_bytes


@dataclass(frozen=True)
class MissPath:
    """One way a miss is served: what the manager, the clocks and the runtime's engines ask of it.
    The only place a path's name is read is this module; elsewhere code asks these fields."""

    name: str
    code: int
    """Its kind in the compiled manager (`compiled.layout`), unique over paths and rules."""
    takes_slot: bool
    """Copied into a slot (evicting a victim), so later uses hit."""
    on_host_cpu: bool
    """Computed by the host CPU next to its host row (only activations cross the link)."""
    twin: bool = False
    """Its low-bit twin is read over the link instead of the expert."""


COPY = MissPath("copy", 0, takes_slot=True, on_host_cpu=False)
IN_PLACE = MissPath("in-place", 1, takes_slot=False, on_host_cpu=False)
CPU = MissPath("cpu", 2, takes_slot=False, on_host_cpu=True)
CPU_COPY = MissPath("cpu+copy", 4, takes_slot=True, on_host_cpu=True)
"""On the host CPU now, and copied into a slot behind (a prefetch due at its layer of the next token)."""
TWIN = MissPath("twin", 5, takes_slot=False, on_host_cpu=False, twin=True)
OFF_POOL = (IN_PLACE, CPU, TWIN)
"""The paths that serve a miss without a slot (`PoolObserver.on_off_pool`), by their index in the
compiled manager's events."""


@dataclass(frozen=True)
class MissRule:
    """How a system serves its misses (the `miss` option): always one path, or chosen per miss."""

    name: str
    code: int
    """Its kind in the compiled manager (`compiled.layout`)."""
    path: MissPath | None
    """The path every miss takes; None: chosen per miss (`auto_path`)."""

    @property
    def may_use_host_cpu(self) -> bool:
        """Some misses may be computed on the host CPU (which needs its cost, and a host executor)."""
        return self.path is None or self.path.on_host_cpu

    @property
    def always_host_cpu(self) -> bool:
        """Every miss is computed on the host CPU (the hardware profile must describe a host)."""
        return self.path is not None and self.path.on_host_cpu


MISS_RULES = {r.name: r for r in (MissRule("copy", COPY.code, COPY), MissRule("in-place", IN_PLACE.code, IN_PLACE),
                                  MissRule("cpu", CPU.code, CPU), MissRule("auto", 3, None))}
"""The miss rules by the name an option gives."""
MISS_PATHS = tuple(MISS_RULES)
"""How misses may be served: always copied, always read in place, always on the host CPU, or chosen per miss."""


def check_miss(miss: str) -> str:
    """`miss` when it names a miss rule; UserError listing them otherwise."""
    miss_rule(miss)
    return miss


def miss_rule(miss: str) -> MissRule:
    """The miss rule named `miss`; UserError listing them for another name."""
    if miss not in MISS_RULES:
        raise UserError(f"unknown miss path {miss!r}; choose one of: {', '.join(MISS_PATHS)}")
    return MISS_RULES[miss]


DEFAULT_TWIN_BUDGET = 0.5
"""Gate weight per token the twins may serve when no budget is given (summed over the token's layers)."""


@dataclass(frozen=True)
class Twin:
    """The low-bit twin miss path of the module docstring."""

    precision: str
    """Precision of the twins (`seqmoe.costs.precision.PRECISIONS`): fewer bytes than the store's."""
    budget: float
    """Gate weight per token the twins may serve, summed over the token's MoE layers."""


def check_twin(precision: str | None, budget: float | None, store: str | None = None) -> Twin | None:
    """The twin path `precision` and `budget` describe (None: off); UserError for a bad value, or for a
    twin no smaller than a `store` of seqmoe's precisions (other stores are compared once their bytes are known)."""
    if precision is None:
        if budget is not None:
            raise UserError("twin_budget (--twin-budget) is the budget of the twin miss path: give its precision too "
                            f"(twin=, --twin: one of {', '.join(PRECISIONS)})")
        return None
    if precision not in PRECISIONS:
        raise UserError(f"unknown twin precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if store in PRECISIONS and quantized_bytes(GROUP, precision) >= quantized_bytes(GROUP, store):
        raise UserError(f"twin precision {precision} is not smaller than the {store} experts it would stand in for: choose a "
                        "lower twin precision (--twin)")
    budget = DEFAULT_TWIN_BUDGET if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
        raise UserError(f"twin_budget (--twin-budget) is gate weight per token, a number >= 0; got {budget!r}")
    return Twin(precision, float(budget))


def pick_twins(missing: np.ndarray, weights: np.ndarray, left: float) -> np.ndarray:
    """[K] bool: the layer's misses its twins may serve: misses (`missing`) taken smallest `weights`
    first while their sum stays within `left`, the token's budget left."""
    w = np.where(missing, np.asarray(weights, dtype=np.float64), np.inf)
    order = np.argsort(w, kind="stable")
    spent = np.cumsum(w[order])
    n = min(int(np.searchsorted(spent, left, side="right")), int(np.count_nonzero(missing)))
    mask = np.zeros(len(w), dtype=bool)
    mask[order[:n]] = True
    return mask


def twin_waits_for_cpu(m, now: float) -> bool:
    """Memory manager `m` (its `miss` cpu or auto) would have the host CPU finish an expert handed
    over at `now` before a twin read queued now ends on the link."""
    return m.miss.may_use_host_cpu and m.lane is not None and m.lane.next_end(now) < m.channel.next_demand_end(now, True)


def paths_bound_time_s(*, full_load_time_s: float, activations: int, per_expert_s: float, copy_time_s: float,
                       host_expert_s: float | None, belady_misses: int) -> float:
    """The lower bound on time of the module docstring, for slots, link and (when given) host CPU."""
    A, N = activations, belady_misses
    if host_expert_s is None:
        return max(full_load_time_s, copy_time_s * -(-N // 2))
    m_c = np.arange(A + 1, dtype=np.float64)
    rest = np.maximum(0.0, N - 2 * m_c)
    terms = np.maximum(np.maximum(full_load_time_s - per_expert_s * m_c, copy_time_s * np.ceil(rest / 2)),
                       host_expert_s * m_c)
    return float(terms.min())


def auto_path(m, uid: int, now: float) -> tuple[MissPath, int | None]:
    """How memory manager `m` serves the miss of `uid` at `now` (its miss rule's path; for `auto` the
    rule of the module docstring), and the victim a copy displaces (None: the policy picks, or no
    copy). `auto` may also take `CPU_COPY`, when the expert is worth its slot."""
    if m.miss.path is not None:
        return m.miss.path, None
    link = m.channel.next_demand_end(now)
    on_cpu = m.lane is not None and m.lane.next_end(now) < link
    worth, victim = _worth_a_slot(m, uid)
    if on_cpu:
        idle = m.channel.backlog_end(now) <= now
        return (CPU_COPY, victim) if worth and idle else (CPU, None)
    return (COPY, victim) if worth else (IN_PLACE, None)


def _worth_a_slot(m, uid: int) -> tuple[bool, int | None]:
    """Whether `uid` is worth a slot (a free one, or the victim's, valued lower by the policy), and the victim."""
    if m.num_present < m.capacity:
        return True, None
    policy = m.system.policy
    victim = policy.victim(uid, m.pinned)
    if victim is None:
        return False, None
    mine, theirs = policy.keep_value([uid]), policy.keep_value([victim])
    return (mine is None or mine[0] > theirs[0]), victim

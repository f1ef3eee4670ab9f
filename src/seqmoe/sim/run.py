"""Run replays from configurations: load traces and profiles once, replay systems x residencies.

    rows = run_sweep(SimConfig(trace=..., train=...), systems=["on-demand-lru", "belady"],
                     residencies=[0.25, 0.45])
"""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqmoe import __version__
from seqmoe.brain.policies.belady import FutureUses, belady_misses
from seqmoe.config import SimConfig
from seqmoe.brain.manager.host_tier import host_policy
from seqmoe.base.errors import UserError
from seqmoe.brain.manager import SystemInputs, build_system, capacity_for, manager_kind, start_placement, summarize
from seqmoe.brain.manager.miss_paths import check_twin
from seqmoe.brain.manager.placement import capacity_for_bytes, reset_starts
from seqmoe.costs.precision import format_bytes, parse_bytes
from seqmoe.brain.manager.systems import system_spec
from seqmoe.brain.predict.baselines.external import ExternalPredictor, load_predictions
from seqmoe.brain.predict.provide import seq_predictor_for
from seqmoe.brain.predict.online import OnlineForecaster, cold_prior, online_forecaster
from seqmoe.costs.profiles import HardwareProfile, ModelProfile, free_link, get_hardware_profile, get_model_profile
from seqmoe.sim import simulate
from seqmoe.sim.lockstep import lockstep
from seqmoe.sim.protocol import replay_per_request, scored_tokens, untimed
from seqmoe.sim.prefill import check_prompt_lengths, prefill_costs, prefill_fields, prompt_starts
from seqmoe.trace.io import load_trace
from seqmoe.trace.schema import RoutingTrace, check_dims
from seqmoe.trace.split import split_trace

SCHEMA_VERSION = 1
WALL_CLOCK_FIELDS = ("sim_wall_s", "activations_per_s", "decision_us_per_token")
"""Fields of a row measured on the clock of the machine that ran it: they differ between runs of one
configuration (serial or as Ray tasks); every other field is the same."""


@dataclass(frozen=True)
class Workload:
    """Everything a replay needs that does not depend on the system or the residency."""

    train: RoutingTrace
    test: RoutingTrace
    model: ModelProfile
    hardware: HardwareProfile
    test_uids: np.ndarray  # [T, L, K] int64
    future: FutureUses
    predictors: dict = dataclasses.field(default_factory=dict)  # forecasters loaded so far, by checkpoint path
    belady_misses: dict = dataclasses.field(default_factory=dict)  # N_opt by (capacity, batch), computed once
    plans: dict = dataclasses.field(default_factory=dict)  # (batch, admission) -> (Lockstep, [S, L, W] uids visited, FutureUses)


def load_workload(cfg: SimConfig, *, train: RoutingTrace | None = None, test: RoutingTrace | None = None) -> Workload:
    """Load (or take) the traces and profiles of `cfg` and check that they fit together."""
    model, hardware = get_model_profile(cfg.model_profile), get_hardware_profile(cfg.hardware)
    if test is None:
        test = load_trace(cfg.trace)
        if train is None and cfg.train is None and not cfg.online:
            train, test = split_trace(test, test_fraction=cfg.test_fraction, seed=cfg.seed)
    if train is None and cfg.train is None:
        # --online trains on nothing, so the whole trace is replayed; the systems it admits read only the
        # shape of `train` (learning ones and a frequency reset are refused), so the test stands in for it
        train = test
    if train is None:
        train = load_trace(cfg.train)
    if cfg.max_tokens is not None:
        test = test.head(cfg.max_tokens)
    for name, t in (("--trace", test), ("--train", train)):
        check_dims(name, t, model, "pick the matching --model-profile")
    uids = test.uids()
    return Workload(train, test, model, hardware, uids, FutureUses(uids, test.num_layers * test.num_experts))


def host_info() -> dict:
    """Where a result was computed."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None
    return {"git_sha": sha, "seqmoe": __version__, "python": platform.python_version(),
            "numpy": np.__version__, "platform": platform.platform(), "processor": platform.machine()}


def run_one(w: Workload, cfg: SimConfig, *, progress: bool = False, prompt_lengths=()) -> dict:
    """Replay `w.test` with `cfg.system` at `cfg.residency`; the result row as a dict. `prompt_lengths`:
    also the time to first token of prompts of these lengths from the pool at each request start
    (`seqmoe.sim.prefill`; in a batch, at the step where the request starts), in the row's `prefill`."""
    test, model = w.test, w.model.at_precision(cfg.expert_dtype)
    lengths = check_prompt_lengths(prompt_lengths, test.num_tokens)
    if lengths and cfg.reset is not None:
        raise UserError("--prompt-lengths prices prompts from the pool each request meets, and under --reset that is "
                        "the reset's pool, not the system's: drop one of them")
    costs = prefill_costs(model, w.hardware) if lengths else None
    pools = {int(s): None for n in lengths for s in prompt_starts(test.request_offsets, test.num_tokens, n)}
    L, E, K = test.num_layers, test.num_experts, test.top_k
    if cfg.expert_memory is None:
        capacity, residency = capacity_for(cfg.residency, L, E, K), cfg.residency
    else:
        budget = parse_bytes(cfg.expert_memory, "--expert-memory")
        capacity = capacity_for_bytes(budget, model.expert_bytes, L, E, K, f"--expert-memory {format_bytes(budget)}")
        residency = capacity / (L * E)
    start = [] if cfg.online else start_placement(w.train, capacity)
    n_opt, twin = None, check_twin(cfg.twin, cfg.twin_budget)
    plan, visits, future = _plan(w, cfg.batch, cfg.admission)
    # Belady's count is of the recorded routing with full-size copies from one start: no bound for a replay
    # that changes the routing, reads smaller twins, resets the pool or scores only part of the trace.
    if cfg.routing == "exact" and twin is None and cfg.reset is None and not cfg.warmup:
        key = (capacity, cfg.batch, cfg.admission if cfg.batch > 1 else "fifo")
        if key not in w.belady_misses:
            w.belady_misses[key] = belady_misses(w.test_uids if visits is None else visits, capacity, start, future)
        n_opt = w.belady_misses[key]
    host_rows, disk_n_opt = cfg.host_rows(), None
    if host_rows is not None and n_opt is not None:  # the two tiers hold C + H experts (docs/DESIGN.md, "The disk tier")
        key = (capacity + host_rows, cfg.batch, cfg.admission if cfg.batch > 1 else "fifo")
        if key not in w.belady_misses:
            w.belady_misses[key] = belady_misses(w.test_uids if visits is None else visits, capacity + host_rows,
                                                 start, future)
        disk_n_opt = w.belady_misses[key]
    predictor, prior = None, None
    if system_spec(cfg.system).needs_predictor and cfg.online:
        predictor, prior = online_forecaster(L, E, K, seed=cfg.seed), cold_prior(L, E, K)
    elif system_spec(cfg.system).needs_predictor:
        if cfg.predictor not in w.predictors:
            w.predictors[cfg.predictor] = seq_predictor_for(cfg.predictor, w.train, progress=progress)
        predictor = w.predictors[cfg.predictor]
    external, lead_note = _external(cfg, test) if system_spec(cfg.system).needs_predictions else (None, None)
    inputs = SystemInputs(train=w.train, test=test, capacity=capacity, start=tuple(start), predictor=predictor,
                          prior=prior, draft=cfg.draft, visits=visits, predictions=external)
    system = build_system(cfg.system, inputs, cfg.miss, twin)
    hardware = free_link(w.hardware) if cfg.link == "free" else w.hardware
    scored = scored_tokens(test.request_offsets, cfg.warmup) if cfg.warmup else None

    def replay(span, start):
        return simulate(test, system, model=model, hardware=hardware, capacity=capacity, start=start,
                        progress=progress and cfg.reset is None, max_kl=cfg.max_kl, window_tokens=cfg.window_tokens,
                        plan=plan, pools=pools or None, host_rows=host_rows, host_policy=cfg.host_policy, scored=scored,
                        span=span)

    t0 = time.perf_counter()
    if cfg.reset is None:
        counts = replay(None, start)
    else:
        starts = reset_starts(cfg.reset, capacity=capacity, num_uids=L * E, seed=cfg.seed,
                              frequency=start_placement(w.train, capacity))
        counts = replay_per_request(test, replay, starts=starts)
    wall = time.perf_counter() - t0
    row = {"schema_version": SCHEMA_VERSION, "system": cfg.system, **manager_kind(system), "residency": residency,
           "capacity": capacity,
           "miss": system.miss, "expert_dtype": cfg.expert_dtype, "memory_bytes": capacity * model.expert_bytes,
           "twin": cfg.twin, "twin_budget": None if twin is None else twin.budget, "online": cfg.online,
           "draft": cfg.draft, "batch": cfg.batch, "admission": cfg.admission}
    if isinstance(predictor, OnlineForecaster):
        row["forecaster"] = predictor.stats()
    if host_rows is not None:
        row.update(host_residency=host_rows / (L * E), host_memory_bytes=host_rows * model.expert_bytes,
                   host_policy=cfg.host_policy or host_policy(system))
    row.update(summarize(counts, expert_bytes=model.expert_bytes, belady_misses=n_opt, disk_belady_misses=disk_n_opt))
    row.update(link=cfg.link, reset=cfg.reset, warmup=cfg.warmup)
    if lead_note:
        row["predictions_note"] = lead_note
    if cfg.link == "free":
        untimed(row)
    if lengths:
        row["prefill"] = prefill_fields(test.expert_ids, test.request_offsets, pools, lengths, costs, system.miss)
    row.update({
        "num_tokens": test.num_tokens, "num_requests": test.num_requests, "train_tokens": 0 if cfg.online and cfg.train is None else w.train.num_tokens,
        "model_profile": model.to_dict(), "hardware_profile": hardware.to_dict(),
        "sim_wall_s": wall, "activations_per_s": row["activations"] / wall,
        "config": cfg.to_dict(), "config_hash": cfg.config_hash(), "host": host_info(),
    })  # fmt: skip
    return row


def _external(cfg: SimConfig, test) -> tuple:
    """(the predictor replaying `cfg.predictions` or None, why it is None): a prediction known only at its
    layer's own gate (lead 0) arrives with the routing, too late to prefetch on a priced link."""
    if cfg.prediction_lead == 0 and cfg.link == "priced":
        return None, ("lead-0 predictions arrive with the layer's routing, too late for a priced copy: replayed "
                      "as the LRU alone (use --link free to score the predictions)")
    predicted = load_predictions(cfg.predictions, test)
    return ExternalPredictor(predicted, test.request_offsets, num_experts=test.num_experts,
                             lead=cfg.prediction_lead), None


def _plan(w: Workload, batch: int, admission: str):
    """(lockstep plan, [S, L, W] uids it visits, their FutureUses) of a batched replay, made once per
    batch and admission rule; (None, None, w.future) at batch 1."""
    if batch == 1:
        return None, None, w.future
    if (batch, admission) not in w.plans:
        plan = lockstep(w.test, batch, admission)
        visits = plan.uids(w.test)
        w.plans[batch, admission] = (plan, visits, FutureUses(visits, w.test.num_layers * w.test.num_experts))
    return w.plans[batch, admission]


def sweep_runs(cfg: SimConfig, systems, residencies, expert_dtypes=(None,), *, traces=None,
               hardware=None) -> list[SimConfig]:
    """Every run of a sweep, in its order: `traces` (default: `cfg.trace`) outermost, then `hardware`
    profiles (default: `cfg.hardware`), residencies (with `cfg.expert_memory` left out: the budget sets the
    slots), expert precisions, and systems innermost. Each is checked as it is built."""
    residencies = [None] if cfg.expert_memory is not None else residencies
    return [dataclasses.replace(cfg, trace=t, hardware=h, system=name, residency=r, expert_dtype=p)
            for t in traces or [cfg.trace] for h in hardware or [cfg.hardware]
            for r in residencies for p in expert_dtypes for name in systems]


def run_sweep(cfg: SimConfig, systems, residencies, expert_dtypes=(None,), *, workload: Workload | None = None,
              progress: bool = False, keep_going: bool = False, prompt_lengths=(), **grid):
    """Yield one result row per run of `sweep_runs(cfg, systems, residencies, expert_dtypes, **grid)`,
    loading each trace once (`workload`: that of `cfg.trace`, already loaded). `keep_going`: a run
    that fails gives its `error_row` and the sweep goes on. `prompt_lengths`: as `run_one`'s."""
    workloads = {} if workload is None else {cfg.trace: workload}
    for run in sweep_runs(cfg, systems, residencies, expert_dtypes, **grid):
        if run.trace not in workloads:
            workloads[run.trace] = load_workload(run)
        w = with_hardware(workloads[run.trace], run.hardware)
        yield (run_or_error if keep_going else run_one)(w, run, progress=progress, prompt_lengths=prompt_lengths)


def with_hardware(w: Workload, hardware: str) -> Workload:
    """`w` on the hardware profile `hardware`, sharing its caches (none depends on the hardware)."""
    return w if w.hardware.name == hardware else dataclasses.replace(w, hardware=get_hardware_profile(hardware))


def run_or_error(w: Workload, cfg: SimConfig, *, progress: bool = False, prompt_lengths=()) -> dict:
    """`run_one(w, cfg)`, or its `error_row` if the run fails."""
    try:
        return run_one(w, cfg, progress=progress, prompt_lengths=prompt_lengths)
    except Exception as e:  # the run's own error: reported in its row
        return error_row(cfg, e)


def error_row(cfg: SimConfig, error: BaseException | str) -> dict:
    """The row of a run that failed: what it was and why (`error`; `traceback` unless a UserError)."""
    row = {"schema_version": SCHEMA_VERSION, "system": cfg.system, "residency": cfg.residency,
           "expert_dtype": cfg.expert_dtype, "error": error if isinstance(error, str) else _describe(error)}
    if isinstance(error, BaseException) and not isinstance(error, UserError):
        row["traceback"] = "".join(traceback.format_exception(error))
    return row | {"config": cfg.to_dict(), "config_hash": cfg.config_hash(), "host": host_info()}


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"

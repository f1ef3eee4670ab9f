"""`seqmoe sweep --ray`: the runs of a sweep as Ray tasks, on a local Ray or an existing cluster.

    rows = ray_sweep(sweep_runs(cfg, systems, residencies), address=None)  # rows in the runs' order

Each run is one task. Each trace's workload (its traces, profiles and future uses) goes to the
object store once; a worker process reads it once and keeps it, with the Belady counts it computes,
for the later runs it is given. A forecaster to train is trained by one task, and the runs that need
it wait for that task alone (a --predictor checkpoint is read here and sent once). A run's own
error comes back as its row (`run.error_row`); a task whose worker process dies is run again (Ray's
retries, `MAX_RETRIES`), and after that its row says so. Ctrl-C cancels every task not yet
finished. On a cluster every node needs seqmoe installed.

Runs go out as CPUs free up (one a task), the longest expected first: a run is expected to take as
long as the last finished run of its system on its trace took, and a system not timed yet goes
first. Without that, a sweep's slowest runs (its last residency's) could start last and run alone.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable

from tqdm.auto import tqdm

from seqmoe.base.errors import UserError, needs_extra
from seqmoe.brain.manager.systems import system_spec
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.brain.predict.provide import seq_predictor_for
from seqmoe.config import SimConfig
from seqmoe.sim.run import Workload, error_row, load_workload, run_or_error, with_hardware

MAX_RETRIES = 3
"""Times Ray runs a task again after its worker process died (then its row reports the failure)."""

_WORKLOADS: dict[str, Workload] = {}
"""In a worker process: the workloads it has read, by object id, kept for its later runs."""


def ray_sweep(runs: list[SimConfig], *, address: str | None = None, progress: bool = False,
              on_row: Callable[[dict], None] | None = None, workloads: dict[str, Workload] | None = None,
              prompt_lengths: tuple[int, ...] = ()) -> list[dict]:
    """Run `runs` (`seqmoe.sim.run.sweep_runs`) as Ray tasks; their rows in the order of `runs`.

    address: an existing cluster's ("auto", "ray://host:10001", host:port); None starts a local Ray
    with a worker per core for the sweep and stops it after. A Ray already started in this process
    is used as it is. `on_row` gets each row as its task finishes; a progress bar counts them.
    `workloads`: those already loaded, by trace (`run.trace`); the others are loaded here.
    `prompt_lengths`: every run also prices prompts of these lengths (`run_one`)."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)  # Ray's start-up notices would bury the sweep's lines
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise UserError(f"could not start or reach Ray at {address or 'a local instance'}: {e}") from None
    try:
        return _run_all(ray, runs, progress, on_row, workloads or {}, tuple(prompt_lengths))
    finally:
        if started:
            ray.shutdown()


def _run_all(ray, runs: list[SimConfig], progress: bool, on_row, loaded: dict[str, Workload],
             prompt_lengths: tuple[int, ...]) -> list[dict]:
    run_task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES)(_run)
    train_task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES)(_forecaster)
    workloads, forecasters, needs = {}, {}, [None] * len(runs)
    for i, run in enumerate(runs):
        if run.trace not in workloads:  # loaded here, sent once
            workloads[run.trace] = ray.put(loaded.get(run.trace) or load_workload(run))
        if system_spec(run.system).needs_predictor and not run.online:
            key = (run.trace, run.predictor)
            if key not in forecasters:  # a checkpoint is read here; training is a task (it takes minutes)
                forecasters[key] = (ray.put(load_seq_predictor(run.predictor)) if run.predictor is not None
                                    else train_task.remote([workloads[run.trace]]))
            needs[i] = forecasters[key]
    slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
    training = set(forecasters.values())  # until ready (a checkpoint sent with ray.put is at once)
    todo, running, took, rows = list(range(len(runs))), {}, {}, [None] * len(runs)
    try:
        with tqdm(total=len(runs), desc="sweep", unit="run", disable=not progress, file=sys.stderr) as bar:
            while todo or running:
                while todo and len(running) + len(training) < slots:
                    ready = [i for i in todo if needs[i] not in training]
                    if not ready:
                        break
                    i = min(ready, key=lambda i: (-took.get(_kind(runs[i]), math.inf), i))  # longest expected first
                    todo.remove(i)
                    box = [needs[i]] if needs[i] is not None else []
                    running[run_task.remote(runs[i], [workloads[runs[i].trace]], box, prompt_lengths)] = (
                        i, time.monotonic())
                done = ray.wait([*running, *training], num_returns=1)[0][0]  # refs in lists above: fetched by the task
                if done in training:
                    training.discard(done)
                    continue
                i, began = running.pop(done)
                took[_kind(runs[i])] = time.monotonic() - began
                try:
                    rows[i] = ray.get(done)
                except ray.exceptions.RayError as e:  # its worker died more than MAX_RETRIES times, or Ray failed
                    rows[i] = error_row(runs[i], f"its Ray task failed (a dead worker's is retried {MAX_RETRIES} "
                                                 f"times): {e}")
                bar.update()
                if on_row is not None:
                    with tqdm.external_write_mode(file=sys.stderr):  # lines printed above the bar
                        on_row(rows[i])
    except KeyboardInterrupt:
        for ref in [*running, *training]:
            ray.cancel(ref, force=True)
        raise
    return rows


def _kind(run: SimConfig) -> tuple:
    """Runs expected to take about as long as each other (the sweep learns how long from the first)."""
    return run.trace, run.system


def _workload(boxed: list) -> Workload:
    import ray  # ray: only when this runs

    key = boxed[0].hex()
    if key not in _WORKLOADS:
        _WORKLOADS[key] = ray.get(boxed[0])
    return _WORKLOADS[key]


def _forecaster(workload: list):
    """The task that trains the forecaster of a trace's runs once (or finds it trained: `seq_predictor_for`)."""
    return seq_predictor_for(None, _workload(workload).train)


def _run(run: SimConfig, workload: list, forecaster: list, prompt_lengths: tuple[int, ...] = ()) -> dict:
    """The task of one run: its row (`run_or_error`)."""
    import ray  # ray: only when this runs

    w = with_hardware(_workload(workload), run.hardware)
    if forecaster and run.predictor not in w.predictors:
        try:
            w.predictors[run.predictor] = ray.get(forecaster[0])
        except ray.exceptions.RayTaskError as e:  # training failed: every run that needs it says why
            return error_row(run, f"training the forecaster failed: {e.cause if e.cause is not None else e}")
    return run_or_error(w, run, prompt_lengths=prompt_lengths)


def _import_ray():
    try:
        import ray  # ray: only when this runs
    except ImportError:
        raise needs_extra("--ray needs Ray", "ray") from None
    return ray

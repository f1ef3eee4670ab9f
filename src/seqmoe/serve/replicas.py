"""`seqmoe serve --replicas N [--ray ADDRESS]`: N replicas of the server on Ray Serve, behind its HTTP proxy.

    spec = ReplicaSpec(replicas=2, start={"max_batch": 8}, app={"api_key": None, "limits": Limits()})
    status = serve_replicas(load, cfg, spec, host="127.0.0.1", port=8000)   # until SIGTERM or SIGINT

Each replica is a Ray actor that loads and offloads the model as `seqmoe serve` does
(`start_batcher`) and answers with the same app (`create_app`): the OpenAI routes, the API key, its
own /metrics and /health, its name in /stats and in the `seqmoe_replica_info` metric. Ray Serve's
proxy spreads the requests over the replicas; one whose process dies is replaced by Ray Serve's
controller, and the requests it was serving fail (a client's retry reaches a live replica). A replica
has a GPU of its own where the device is CUDA, and `cpus` cores, on which its model threads are
sized as `LoadConfig.torch_threads` sizes them on a machine of that many cores.

SIGTERM drains as one server does: each replica sees a flag (`DrainFlag`, a Ray actor the driver
sets), answers new requests with a 503 and `Retry-After` and reports when it is idle; the deployment
is removed once all are, or after the drain timeout. SIGINT stops at once. Either way a Ray started
here is stopped with it; on a cluster only this deployment goes.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from seqmoe.base.errors import UserError, needs_extra
from seqmoe.config import LoadConfig, OffloadConfig, usable_cores

APP = "seqmoe"
"""The Ray Serve application's name (and its deployment's)."""

DRAIN_POLL_S = 0.5
"""Seconds between a replica's looks at the drain flag."""

HEALTH_PERIOD_S = 2.0
"""Seconds between Ray Serve's health checks of a replica (a dead batcher thread fails one)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """How many replicas, what each gets, and how each starts: `start` are `start_batcher`'s keywords,
    `app` are `create_app`'s (`api_key`, `limits`)."""

    replicas: int
    cpus: int = 1
    gpus: int = 0
    drain_timeout: float = 30.0
    log_level: str = "warning"
    start: dict = field(default_factory=dict)
    app: dict = field(default_factory=dict)
    drain_flag: str = field(default_factory=lambda: f"drain-{os.getpid()}-{time.time_ns()}")


class DrainFlag:
    """Set by the driver on SIGTERM (a Ray actor of no CPU); every replica polls it, and once it is set
    reports whether it still has requests, until the driver sees them all idle."""

    def __init__(self) -> None:
        self.on, self.busy = False, {}

    def set(self) -> None:
        self.on = True

    def get(self) -> bool:
        return self.on

    def report(self, replica: str, busy: bool) -> None:
        self.busy[replica] = busy

    def idle(self, replicas: int) -> bool:
        return len(self.busy) >= replicas and not any(self.busy.values())


class Replica:
    """One replica: the loaded model, its batcher and its app (Ray Serve's ASGI ingress builds the app
    with `__serve_build_asgi_app__` once the constructor has loaded the model)."""

    def __init__(self, load: LoadConfig, cfg: OffloadConfig, spec: ReplicaSpec) -> None:
        from seqmoe.serve.startup import start_batcher  # torch: in the replica's process only

        self.spec, self.api = spec, None
        self.served = start_batcher(load, cfg, **spec.start)

    def __serve_build_asgi_app__(self):
        from ray import serve

        from seqmoe.serve.api import create_app

        s, tag = self.served, serve.get_replica_context().replica_tag
        app = create_app(s.batcher, s.tokenizer, model_name=s.name, context_length=s.context_length,
                         temperature=s.temperature, top_p=s.top_p, replica=tag, **self.spec.app)
        self.api = app.state.api
        threading.Thread(target=self._watch_drain, args=(tag,), name="seqmoe-drain-watch", daemon=True).start()
        return app

    def _watch_drain(self, replica: str) -> None:
        import ray

        try:
            flag = ray.get_actor(self.spec.drain_flag, namespace=APP)
            while not ray.get(flag.get.remote(), timeout=DRAIN_POLL_S * 10):
                time.sleep(DRAIN_POLL_S)
            self.api.draining = True  # new requests get a 503 with Retry-After, /health a 503
            while True:
                c = self.served.batcher.counts()
                flag.report.remote(replica, bool(c["running"] or c["waiting"] or self.api.open_requests))
                time.sleep(DRAIN_POLL_S)
        except Exception:  # the driver is gone (its flag with it): Ray Serve stops this replica
            return

    def describe(self) -> tuple[str, str]:
        """(the served model's name, the one-line summary of its offload and batch)."""
        return self.served.name, self.served.summary

    def check_health(self) -> None:  # Ray Serve's health check: a replica that raises is replaced
        if not self.served.batcher.alive():
            raise RuntimeError("the batcher thread has stopped")

    def __del__(self) -> None:  # Ray Serve's graceful stop of a replica
        served = getattr(self, "served", None)
        if served is not None:
            served.close()


def replica_spec(load: LoadConfig, cfg: OffloadConfig, replicas: int, address: str | None, **kw) -> tuple[LoadConfig, ReplicaSpec]:
    """The spec of `replicas` replicas, and `load` with each replica's model threads: `--threads`, else the
    default budget (`LoadConfig.torch_threads`) of this machine's cores split between the replicas (on a
    cluster, give --threads: its nodes may not be this one)."""
    if replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {replicas}")
    cores = usable_cores()
    cpus = load.threads or max(1, cores // replicas)
    if address is None and cpus * replicas > cores:
        raise UserError(f"{replicas} replicas of {cpus} cores each do not fit this machine's {cores} cores; give "
                        f"fewer --replicas or --threads, or a cluster with --ray ADDRESS")
    threads = load.torch_threads(cpus)
    gpus = 1 if str(cfg.device or _default_device()).startswith("cuda") else 0
    return dataclasses.replace(load, threads=threads), ReplicaSpec(replicas=replicas, cpus=cpus, gpus=gpus, **kw)


def serve_replicas(load: LoadConfig, cfg: OffloadConfig, spec: ReplicaSpec, *, host: str, port: int,
                   address: str | None = None) -> int:
    """Deploy `spec.replicas` replicas on a local Ray (`address` None) or the cluster at `address`, listen on
    host:port (Ray Serve's proxy) until SIGTERM (exit status 0) or SIGINT (130)."""
    ray, serve = _import_ray_serve()
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import LoggingConfig

    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address or "local", include_dashboard=False, logging_level=logging.ERROR,
                     **({"num_cpus": spec.cpus * spec.replicas} if address is None else {}))
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise UserError(f"could not start or reach Ray at {address or 'a local instance'}: {e}") from None
    stop = _Stop()
    try:
        flag = ray.remote(num_cpus=0)(DrainFlag).options(name=spec.drain_flag, namespace=APP).remote()
        logs = LoggingConfig(log_level=spec.log_level.upper())
        serve.start(http_options=HTTPOptions(host=host, port=port), logging_config=logs)
        deployment = serve.deployment(
            serve.ingress()(Replica), name=APP, num_replicas=spec.replicas,
            max_constructor_retry_count=1,  # a replica that cannot load fails the start, not twenty loads later
            ray_actor_options={"num_cpus": spec.cpus, "num_gpus": spec.gpus},
            max_ongoing_requests=_admits(spec.start),
            graceful_shutdown_timeout_s=spec.drain_timeout, health_check_period_s=HEALTH_PERIOD_S,
            logging_config=logs)
        try:
            handle = serve.run(deployment.bind(load, cfg, spec), name=APP, route_prefix="/")
        except Exception as e:  # a replica's constructor failed: its own error, in one line
            raise UserError(f"the replicas did not start: {_replica_error(serve, e)}") from None
        name, summary = handle.describe.remote().result()
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        where = f"Ray at {address}" if address else "a local Ray"
        print(f"seqmoe: serving {name} on {url}/v1 ({spec.replicas} replicas on "
              f"Ray Serve, {where}, each with cores: {spec.cpus}, GPUs: {spec.gpus}, {summary})",
              file=sys.stderr, flush=True)
        sig = stop.wait()
        if sig == signal.SIGTERM:  # new requests get a 503 while the running ones finish
            ray.get(flag.set.remote())
            end = time.monotonic() + spec.drain_timeout
            while time.monotonic() < end and not ray.get(flag.idle.remote(spec.replicas)) and not stop.again:
                time.sleep(DRAIN_POLL_S)
        serve.delete(APP, _blocking=sig == signal.SIGTERM and not stop.again)
        return 130 if sig == signal.SIGINT else 0
    finally:
        stop.restore()
        if started:
            if address is None:
                serve.shutdown()
            ray.shutdown()


class _Stop:
    """SIGTERM and SIGINT as an event the main thread waits on; `again`: a second signal (stop waiting)."""

    def __init__(self) -> None:
        self.event, self.signal, self.again = threading.Event(), None, False
        self.old = {s: signal.signal(s, self._on) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on(self, sig: int, frame) -> None:
        if self.event.is_set():
            self.again = True
            return
        self.signal = sig
        self.event.set()

    def wait(self) -> int:
        while not self.event.wait(0.5):  # a timed wait: signals reach the main thread in between
            pass
        return self.signal

    def restore(self) -> None:
        for s, old in self.old.items():
            signal.signal(s, old)


def _admits(start: dict) -> int:
    """Requests a replica takes at once: its batcher's rows and queue, and one more that it answers 429
    (Ray Serve would otherwise queue them in front of it, at 5 a replica by default)."""
    from seqmoe.serve.startup import start_batcher  # its defaults, where `start` leaves them out

    given = {k: p.default for k, p in inspect.signature(start_batcher).parameters.items()} | start
    return given["max_batch"] + given["queue_limit"] + 1


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _replica_error(serve, e: BaseException) -> str:
    """The replicas' own error (a UserError's message as it is) from the deployment's status, else `e`'s."""
    try:
        text = serve.status().applications[APP].deployments[APP].message
    except Exception:  # no status to read: Ray's own error is all there is
        text = ""
    lines = [line.strip() for line in f"{text}\n{e}".splitlines() if line.strip()]
    ours = [line.split("UserError: ", 1)[1] for line in lines if "UserError: " in line]
    errors = [line for line in lines if "Error:" in line]
    return (ours or errors or lines or [type(e).__name__])[-1]


def _import_ray_serve():
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise needs_extra("seqmoe serve --replicas needs Ray Serve", "ray", e) from None
    return ray, serve

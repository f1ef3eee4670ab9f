"""`GET /metrics` of `seqmoe serve`: the server's and the runtime's figures in Prometheus' text format.

    metrics = ServerMetrics()
    metrics.request("/v1/completions", 200)       # by the HTTP guard, for every answered request
    metrics.first_token(0.12); metrics.token_gap(0.01)   # by the handlers, as tokens are emitted
    text = metrics.render(batcher_counts, runtime_stats)  # at a scrape

Counters and histograms move as requests are served; what the batcher and the runtime count
(tokens, queue, hits, copies, bytes) is read at each scrape from `Batcher.counts()` and
`OffloadRuntime.stats()`, so there is one home for each figure. Each app has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_SERVER = {  # gauge name: (help, the Batcher.counts() key)
    "seqmoe_prompt_tokens": ("prompt tokens of the requests served", "prompt_tokens"),
    "seqmoe_completion_tokens": ("completion tokens generated", "completion_tokens"),
    "seqmoe_requests_running": ("requests in the running batch", "running"),
    "seqmoe_requests_waiting": ("requests waiting for a row", "waiting"),
    "seqmoe_max_batch": ("rows of the running batch at most", "max_batch"),
}
_RUNTIME = {  # gauge name: (help, the OffloadRuntime.stats() key)
    "seqmoe_hit_rate": ("share of expert activations resident or on their way", "hit_rate"),
    "seqmoe_expert_copies": ("expert copies over the link", "copies"),
    "seqmoe_link_bytes": ("bytes copied over the link", "bytes_copied"),
    "seqmoe_misses": ("activations whose expert was neither resident nor on its way", "misses"),
    "seqmoe_misses_cpu": ("misses computed on the host CPU", "misses_cpu"),
    "seqmoe_misses_in_place": ("misses read in place from host memory", "misses_in_place"),
    "seqmoe_misses_twin": ("misses served by a low-bit twin", "misses_twin"),
    "seqmoe_disk_bytes": ("bytes read from the checkpoint on disk", "disk_bytes"),
    "seqmoe_disk_reads": ("experts read from the checkpoint on disk", "disk_reads"),
}


class ServerMetrics:
    """The figures of one app (see the module docstring); `replica`: its name among Ray Serve's replicas."""

    def __init__(self, replica: str | None = None) -> None:
        r = self.registry = CollectorRegistry()
        if replica is not None:  # behind Ray Serve's proxy a scrape reaches one replica: it says which
            Info("seqmoe_replica", "the replica that answered this scrape", registry=r).info({"replica": replica})
        self.requests = Counter("seqmoe_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("seqmoe_time_to_first_token_seconds", "from a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("seqmoe_inter_token_latency_seconds", "between two tokens of one request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.gauges = {name: Gauge(name, text, registry=r) for name, (text, _) in {**_SERVER, **_RUNTIME}.items()}
        self.forecaster = Gauge("seqmoe_forecaster_tokens_learned", "tokens the online forecaster has learned, "
                                "by where it came from", ["source"], registry=r)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def render(self, counts: dict, stats: dict | None) -> bytes:
        """The text of a scrape, the gauges set from the batcher's `counts` and the runtime's `stats` (None:
        a model served fully loaded, whose runtime figures are left out)."""
        for name, (_, key) in _SERVER.items():
            self.gauges[name].set(counts[key])
        for name, (_, key) in _RUNTIME.items():
            value = None if stats is None else stats.get(key)
            if isinstance(value, (int, float)):
                self.gauges[name].set(value)
        fc = None if stats is None else stats.get("forecaster")
        if fc is not None:
            self.forecaster.clear()
            self.forecaster.labels(source=str(fc.get("source"))).set(fc.get("tokens_learned") or 0)
        return generate_latest(self.registry)

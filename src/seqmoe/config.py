"""Frozen run configurations and every default; each field's docstring is also its CLI help text
(`seqmoe.cli.args`). A configuration checks all its values when it is built, before any trace,
forecaster or model is loaded, so a bad option fails at once and in one place.

    cfg = SimConfig(trace="test.safetensors", train="train.safetensors", residency=0.45)
    cfg.to_dict(), cfg.config_hash()
    OffloadConfig(residency=0.3, system="on-demand-lru", miss="auto")     # what `seqmoe.offload` takes
    LoadConfig(model="seqmoe-tiny", dtype="float32")                      # which checkpoint, how it is loaded
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from seqmoe.base.errors import UserError
from seqmoe.brain.manager.miss_paths import DEFAULT_TWIN_BUDGET, check_miss, check_twin
from seqmoe.brain.manager.placement import check_residency
from seqmoe.brain.manager.systems import check_live_system, system_spec
from seqmoe.arch.model_dirs import DTYPES, resolve_model_dir
from seqmoe.costs.precision import check_precision, parse_bytes
from seqmoe.brain.predict.drafters import check_draft
from seqmoe.brain.admission import ADMISSIONS
from seqmoe.costs.profiles import HardwareProfile, get_hardware_profile, get_model_profile
from seqmoe.brain.manager.disk_clock import host_rows
from seqmoe.brain.manager.host_tier import POLICIES as HOST_POLICIES
from seqmoe.brain.rerouting import ROUTINGS, check_routing
from seqmoe.costs.profiles import LINKS
from seqmoe.brain.manager.placement import RESETS

DEFAULT_SYSTEM = "on-demand-lru"
"""The system of a replay when none is named: the plain demand-paging baseline every comparison starts from."""
LIVE_SYSTEM = "seqmoe"
"""The system of `offload`, `generate` and `serve` when none is named: seqmoe, its forecaster learned
online when none is given (faster than on-demand-lru from a cold start, simulated and live: docs/RESULTS.md)."""
COMPARED_SYSTEMS = (DEFAULT_SYSTEM, "seqmoe")
"""What the runtime benchmarks compare when not told otherwise."""
DEFAULT_HARDWARE = "h100-pcie5"
"""Hardware profile of the cost model (the simulator's, and the runtime's virtual clock) when none is given."""
DEFAULT_RESIDENCY = 0.45
"""Residency of one run (a replay, an offloaded model) when none is given: the seed paper's headline point."""
COMPARED_RESIDENCIES = (0.25, 0.45, 0.65)
"""Residencies of a quick comparison (the demo, bench-runtime, the real-size harness) when none are given."""
DEFAULT_RESIDENCIES = (0.1, 0.25, 0.45, 0.65, 0.9)
"""Residencies of a sweep when none are given."""
CONTROLS = ("inline", "thread")
"""Where the runtime's control plane runs (`OffloadConfig.control`)."""
MEASURED = "measured"
"""The hardware profile measured on this machine at start (`seqmoe.runtime.core.costs`)."""
CALIBRATION_TOKENS = 20_000
"""Tokens of text `seqmoe calibrate` reads when not told otherwise."""
CLI = "cli"
"""Field metadata: False for fields with no command-line flag (objects, library-only switches)."""
SHOWN_DEFAULT = "shown_default"
"""Field metadata: the default a flag's help names when the field's own is None (resolved later)."""


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """What the simulator and the runtime share: the system that manages the experts, the budgets it
    manages, how its misses are served, and the cost model it decides by. `SimConfig` and
    `OffloadConfig` contain it; a field left None takes its context's default (`DEFAULTS`)."""

    DEFAULTS: ClassVar[dict] = {}
    """Each context's defaults for the fields whose default is None here (filled in when built)."""

    system: str | None = None
    """Memory-management system (see `seqmoe systems`; oracles only replay a trace)."""
    residency: float | None = None
    """Fraction of all experts the device pool holds, in (0, 1]: C = floor(residency x L x E) slots (for a
    running model the default is what --expert-memory holds; without it, on cuda the experts that fit the
    free memory, else 0.45)."""
    expert_memory: str | int | None = field(default=None, metadata={"metavar": "BYTES"})
    """Device memory for the expert pool instead of --residency: bytes, or a size like 12GiB or 512MiB
    (C = the experts of the store's precision that fit, so precisions compare at equal memory); the
    residency it gives is reported."""
    expert_dtype: str | None = field(default=None, metadata={"metavar": "PRECISION"})
    """Precision of the expert store: int8, int4 or fp8 (groups of 64 weights with a float32 scale): host
    rows, copies, slots and reads carry the quantized bytes (a running model's experts are quantized once
    at offload, or as each is read from disk with --host-memory; restore() gives them back at this
    precision, as seqmoe.quantize_experts does); default: the model's (a checkpoint shipped quantized: its
    format). The formats checkpoints ship in are stores too (fp8-block, mxfp4, gptq-int4, q8_0, q5_0, q4_k:
    seqmoe.costs.precision.SHIPPED): a running model encodes its experts into one by round to nearest, a
    replay prices it from the profile's expert_shapes."""
    host_memory: str | int | None = field(default=None, metadata={"metavar": "BYTES"})
    """Host memory for the routed experts, the rest streamed from the checkpoint on disk: a host cache of
    this many bytes (or a size like 8GiB) of expert rows of the store's precision in front of the disk
    (seqmoe.load; generate and serve load that way; a replay needs a hardware profile with
    disk_bytes_per_s); default: every expert in host memory (a model streamed from disk: as many as
    fit in the free host memory, said in a warning when that is not all)."""
    miss: str | None = None
    """How a missed expert is served: copy (into a slot), in-place (read from host memory over the link),
    cpu (computed on the host CPU; needs a hardware profile with a host, and triton with thread control
    on CUDA) or auto (chosen per miss from the cost model's link and host CPU); cpu-all and
    static-split-style fix their own (a running model's default: auto with inline control, copy with
    thread control)."""
    routing: str = ROUTINGS[0]
    """exact, or cache-aware: a missing routed expert may be swapped for a resident one the router scored
    close to it, within --max-kl (`seqmoe.brain.rerouting`; a replay needs a trace collected with
    `seqmoe trace collect --router-logits`; posted steps on CUDA apply it in a kernel)."""
    max_kl: float | None = None
    """Cache-aware routing's budget per token: nats of KL divergence from the router's distribution
    (0.01-0.02 cost seqmoe-tiny under 0.5% perplexity)."""
    twin: str | None = field(default=None, metadata={"metavar": "PRECISION"})
    """Low-bit twin miss path (off by default): every expert also keeps a twin at this precision (int8,
    int4 or fp8, smaller than the store) in host memory, and a miss of small gate weight reads its twin
    over the link instead, within --twin-budget (a replay needs gate weights and reports no bound; a
    running model needs inline control)."""
    twin_budget: float | None = field(default=None, metadata={SHOWN_DEFAULT: DEFAULT_TWIN_BUDGET})
    """Gate weight per token the twins may serve, summed over its MoE layers."""
    draft: str = "none"
    """Look-ahead from guessed tokens for the seqmoe systems: none, or ngram (the request's own repeated
    n-grams guess the next token; the forecaster weighs the guess by its hit rate, counted as it goes).
    It feeds the next token's forecast, which a forecaster with the long-range head leaves to the head."""
    hardware: str | HardwareProfile | None = None
    """Hardware profile of the cost model (the simulator's, and a running model's virtual clock): a preset
    (see `seqmoe profiles`), a .json/.toml file of its fields, or for a running model measured: the
    default profile with this machine's link and host CPU measured at start (its default when misses
    may go to the host CPU, whose choice needs this machine's costs)."""
    train: str | os.PathLike | object | None = field(default=None, metadata={"metavar": "TRACE"})
    """Routing trace of this model: a replay's training split (learned statistics, start placement;
    default: split --trace by request), or a running model's start placement and statistics (needed by
    systems that learn, e.g. affinity-style; without it the pool starts empty): a file, or a
    RoutingTrace (library)."""
    predictor: str | os.PathLike | object | None = field(default=None, metadata={"metavar": "DIR"})
    """Trained forecaster of the seqmoe systems (`seqmoe train`), or a SeqPredictor (library). Without it
    a replay trains one on --train (cached), or with --online learns it from the replayed routing; a
    running model learns it online from the routing served, starting from what this model learned
    before ($SEQMOE_CACHE)."""

    def __post_init__(self) -> None:
        if self.expert_memory is not None:
            parse_bytes(self.expert_memory, "expert_memory (--expert-memory)")
            if self.residency is not None:  # before the defaults fill it: a residency given with a budget
                raise UserError("give a residency or an expert memory budget (--expert-memory), not both")
        for name, value in self.DEFAULTS.items():
            if getattr(self, name) is None and not (name == "residency" and self.expert_memory is not None):
                object.__setattr__(self, name, value)
        if self.residency is not None:
            check_residency(self.residency)
        check_precision(self.expert_dtype, shipped=True)
        if self.host_memory is not None:
            parse_bytes(self.host_memory, "host_memory")
        if self.miss is not None:
            check_miss(self.miss)
        check_routing(self.routing, self.max_kl)
        check_twin(self.twin, self.twin_budget, self.expert_dtype)
        check_draft(self.draft)


@dataclass(frozen=True, kw_only=True)
class SimConfig(ManagerConfig):
    """One replay of a trace by one system at one residency."""

    trace: str
    """Trace to replay: a saved .safetensors trace, a MoE-Beyond CSV folder or a Mixtral JSONL file/folder."""
    test_fraction: float = 0.2
    """Without --train: the share of --trace's requests replayed (the rest trains; with --online, which trains
    on nothing, the whole trace is replayed)."""
    max_tokens: int | None = None
    """Replay only the first N tokens of the replayed trace (quick looks; default: all)."""
    model_profile: str = "deepseek-v2-lite"
    """Model profile: a preset name (see `seqmoe profiles`) or a .json/.toml file of its fields."""
    online: bool = False
    """Replay with no training data: every system starts from an empty pool, and the seqmoe systems learn
    their forecaster from the replayed routing as the runtime does (`seqmoe.brain.predict.online`)."""
    window_tokens: int | None = None
    """Also report hit rate and time per window of this many replayed tokens (`windows` in the JSON)."""
    batch: int = 1
    """Sequences decoded together: B requests of the trace in lockstep, a finished one replaced by the
    next (docs/DESIGN.md, "Batched decode"); rows then report time per step and tokens/s over all rows."""
    admission: str = "fifo"
    """With --batch: who takes a free lane: fifo (file order) or overlap (the waiting request whose
    routing shares most experts with the running batch's, the head of the queue passed over at most 4
    times; `seqmoe.sim.lockstep`)."""
    seed: int = 0
    """Seed of the train/test split and of anything random in a system."""
    host_residency: float | None = None
    """The host cache as a fraction of all experts, in (0, 1], instead of --host-memory."""
    host_policy: str | None = None
    """The host cache's policy: lru or forecast (default: forecast for systems with a predictor, else lru)."""
    link: str = LINKS[0]
    """priced (copies cost what the hardware profile says) or free (copies cost nothing: hit rates measure
    prediction quality alone, as MoE-Beyond's protocol does; the row's time fields are then None)."""
    reset: str | None = None
    """Replay every request alone from its own start pool: random (--seed), frequency (the training split's
    most used) or empty; default: one pool carried from request to request, starting from frequency's."""
    warmup: int = 0
    """Tokens at the start of each request that are replayed but not scored (MoE-Beyond's protocol: 10)."""
    predictions: str | None = field(default=None, metadata={"metavar": "PATH"})
    """Predictions made elsewhere for moe-beyond-style to replay: a folder of MoE-Beyond predicted CSVs, or a
    .safetensors of predicted_ids [T, L, P] and request_offsets (docs/DESIGN.md, "External predictions")."""
    prediction_lead: int | None = None
    """Positions (token x layer) before its layer each prediction was known: 0 for a predictor that reads the
    layer's own gate input (MoE-Beyond's), which cannot prefetch on a priced link (the row says so)."""

    DEFAULTS = {"system": DEFAULT_SYSTEM, "residency": DEFAULT_RESIDENCY, "miss": "copy", "hardware": DEFAULT_HARDWARE}

    def __post_init__(self) -> None:
        super().__post_init__()
        system_spec(self.system)
        check_batch(self.batch)
        if self.admission not in ADMISSIONS:
            raise UserError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        self.host_rows()
        if not 0.0 < self.test_fraction < 1.0:
            raise UserError(f"--test-fraction must be in (0, 1), got {self.test_fraction}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.window_tokens is not None and self.window_tokens < 1:
            raise UserError(f"--window-tokens must be at least 1, got {self.window_tokens}")
        self._check_protocol()
        if self.online and self.train is None and self.reset == "frequency":
            raise UserError("--reset frequency starts each request from the training split's most used experts, and "
                            "--online without --train has none: give --train, or another --reset")
        if self.online and self.predictor is not None:
            raise UserError("--online learns the forecaster from the replayed routing: drop --predictor")
        if self.online:
            spec = system_spec(self.system)
            if (spec.learns and not spec.needs_predictor) or spec.needs_pregate:
                raise UserError(f"system {self.system!r} learns from a training trace, which --online replays "
                                "without; choose one that learns nothing or a seqmoe system")

    def _check_protocol(self) -> None:
        if system_spec(self.system).needs_predictions and (self.predictions is None or self.prediction_lead is None):
            raise UserError(f"system {self.system!r} replays predictions made elsewhere: give --predictions PATH and "
                            "--prediction-lead N (positions ahead each was known; 0: at the layer's own gate)")
        if self.prediction_lead is not None and (isinstance(self.prediction_lead, bool) or
                                                 not isinstance(self.prediction_lead, int) or self.prediction_lead < 0):
            raise UserError(f"--prediction-lead must be a whole number of positions >= 0, got {self.prediction_lead!r}")
        if self.predictions is not None and self.batch > 1:
            raise UserError("--predictions are per token of a request decoded alone; replay them at --batch 1")
        if self.link not in LINKS:
            raise UserError(f"--link must be one of {', '.join(LINKS)}, got {self.link!r}")
        if self.reset is not None and self.reset not in RESETS:
            raise UserError(f"--reset must be one of {', '.join(RESETS)}, got {self.reset!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise UserError(f"--warmup must be a whole number of tokens >= 0, got {self.warmup!r}")
        if self.reset is not None and self.window_tokens is not None:
            raise UserError("--window-tokens counts windows across requests, and --reset replays each request alone: "
                            "drop one of them")
        if self.batch > 1 and (self.reset is not None or self.warmup):
            raise UserError("--reset and --warmup are per request, and a batched step serves several requests from "
                            "one pool at once: replay them at --batch 1")

    def host_rows(self) -> int | None:
        """H, the host cache's rows (`seqmoe.brain.manager.disk_clock.host_rows`), checked with the options it
        excludes; None without a disk tier."""
        if self.host_memory is None and self.host_residency is None:
            if self.host_policy is not None:
                raise UserError("--host-policy needs a host cache: give --host-memory or --host-residency")
            return None
        if self.host_policy not in (None, *HOST_POLICIES):
            raise UserError(f"--host-policy must be one of {', '.join(HOST_POLICIES)}, got {self.host_policy!r}")
        profile = get_model_profile(self.model_profile)
        model = profile.at_precision(self.expert_dtype)
        twins = 0 if self.twin is None else profile.num_layers * profile.num_experts * profile.at_precision(
            self.twin).expert_bytes  # the twins share the host memory
        return host_rows(self.host_memory, self.host_residency, model, get_hardware_profile(self.hardware), twins)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("host_memory", "host_residency", "host_policy"):  # absent without a disk tier: hashes stay
            if d[k] is None:
                del d[k]
        return d

    def config_hash(self) -> str:
        """12 hex digits identifying this configuration (goes into every result)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def check_batch(batch: int) -> None:
    """UserError unless `batch` (sequences decoded together) is at least 1."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise UserError(f"--batch must be a whole number of sequences, at least 1; got {batch!r}")


def check_bench(new_tokens: int, repeats: int, link_ratio: float) -> None:
    """UserError unless a decode bench has tokens to time (the first comes from the prompt), a pass
    to time, and a link that takes time."""
    if new_tokens < 2 or repeats < 1 or not link_ratio > 0:
        raise UserError(f"need new_tokens >= 2, repeats >= 1 and link_ratio > 0 (got {new_tokens}, {repeats}, {link_ratio})")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig(ManagerConfig):
    """How a model's routed experts are offloaded: every option of `seqmoe.offload` and of the commands
    that offload (generate, serve, bench-runtime), with their defaults."""

    control: str | None = None
    """Where the control plane runs: inline (in the router hooks: the host reads each layer's routing) or
    thread (its own thread fed by a routing mailbox: a decode step never waits for the host and can be
    captured as a CUDA graph); the same decisions and counts either way; default: thread on cuda,
    inline on cpu."""
    device: str | None = None
    """Device of the pool and the dense layers: cpu, cuda or cuda:N (default: the model's; the commands
    take cuda when available)."""
    bandwidth: float | None = None
    """Host->device bytes/s of the cost model (default: the hardware profile's)."""
    learn: bool = field(default=True, metadata={CLI: False})
    """A forecaster learned online keeps learning (False: it stays as it starts; benchmarks)."""
    emulate_link: bool = field(default=False, metadata={CLI: False})
    """CPU only: every expert row crossing the link (a copy, or a missed row read in place) costs one copy
    time of the cost model, and a miss waits for its copy (benchmarks; needs a profile, not measured)."""
    replay: object | None = field(default=None, metadata={CLI: False})
    """The RoutingTrace a harness forces the model to compute (`seqmoe.runtime.timing.forced`): the forecaster
    hashes its tokens as the simulator does, and oracle systems may read its future."""
    record_trace: bool = field(default=True, metadata={CLI: False})
    """Keep every position's routing for `runtime.trace()`: L x K x 6 bytes and a few small arrays per
    position, so a long-running server turns it off."""

    DEFAULTS = {"system": LIVE_SYSTEM}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_live_system(self.system, train=self.train is not None, predictor=self.predictor is not None,
                          replay=self.replay is not None)
        if self.control is not None and self.control not in CONTROLS:
            raise UserError(f"control must be one of: {', '.join(CONTROLS)}; got {self.control!r}")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise UserError(f"device {self.device!r} is not supported by the runtime; pass cpu, cuda or cuda:N")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise UserError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if isinstance(self.hardware, str) and self.hardware != MEASURED:
            get_hardware_profile(self.hardware)  # a preset or a readable profile file
        if self.hardware == MEASURED and (self.bandwidth is not None or self.emulate_link):
            raise UserError("a measured cost model takes its link from this machine: give a hardware profile to use "
                            "a bandwidth or an emulated link")
        if self.emulate_link and str(self.device or "cpu") != "cpu":
            raise UserError(f"an emulated link is for a CPU pool (the {self.device} device has its own link)")
        for value, what in ((self.train, "train trace"), (self.predictor, "predictor folder")):
            if isinstance(value, (str, os.PathLike)) and not Path(value).exists():
                raise UserError(f"no {what} at {value}")

    def for_graph(self) -> OffloadConfig:
        """This configuration for decoding with `DecodeGraph` (`--graph`), which needs thread control."""
        if self.control == "inline":
            raise UserError("--graph needs --control thread")
        return dataclasses.replace(self, control="thread")

    def control_on(self, device_type: str) -> str:
        """Where the control plane runs on a device of `device_type`: on its own thread on CUDA (posted,
        capturable steps), inline on the CPU and for live pre-gating (it reads the hidden states on the
        host as the step runs)."""
        posted = device_type == "cuda" and not system_spec(self.system).needs_pregate
        return self.control or ("thread" if posted else "inline")

    def miss_with(self, control: str) -> str:
        """How misses are served under `control`. By default auto where the host reads each layer's
        routing (faster than copying every miss, simulated and live: docs/LOG.md); a posted step copies
        (its host path is slower on the CPU backend, and not yet measured on a GPU)."""
        return self.miss or ("auto" if control == "inline" else "copy")


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """Which checkpoint a command loads, and how (generate, serve, bench-runtime)."""

    model: str = field(default="seqmoe-tiny", metadata={"metavar": "PATH_OR_NAME"})
    """Model folder with config.json, or a packaged model (seqmoe-tiny); nothing is downloaded."""
    dtype: str = DTYPES[0]
    """Weights dtype: auto (the checkpoint's), float32, bfloat16 or float16."""
    threads: int | None = None
    """torch CPU threads of the model (default: the cores this process may use, less one for the control
    plane, the copy worker and the disk readers; at least one)."""

    def torch_threads(self, cores: int | None = None) -> int:
        """`threads`, else the default budget (see `threads`) of `cores` (default: this process's,
        `usable_cores`): torch's own default takes every core, and the runtime's other threads then
        contend with the model's (a 2-core machine decoded 40 % slower)."""
        if self.threads:
            return self.threads
        return max(1, (cores or usable_cores()) - 1)

    def __post_init__(self) -> None:
        resolve_model_dir(self.model)
        if self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
        if self.threads is not None and (isinstance(self.threads, bool) or not self.threads >= 1):
            raise UserError(f"threads must be >= 1, got {self.threads}")


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

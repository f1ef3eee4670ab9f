"""Frozen run configurations; every field's docstring is also its CLI help text.

    cfg = SimConfig(trace="test.safetensors", train="train.safetensors", residency=0.45)
    cfg.to_dict(), cfg.config_hash()
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import json
from dataclasses import dataclass

from seqmoe.rerouting import ROUTINGS, check_routing
from seqmoe.errors import UserError
from seqmoe.manager.miss_paths import check_miss
from seqmoe.manager.placement import check_residency

DEFAULT_SYSTEM = "on-demand-lru"
"""The system when none is named: the plain demand-paging baseline every comparison starts from."""
COMPARED_SYSTEMS = (DEFAULT_SYSTEM, "seqmoe")
"""What the runtime benchmarks compare when not told otherwise."""
DEFAULT_HARDWARE = "h100-pcie5"
"""Hardware profile of the cost model (the simulator's, and the runtime's virtual clock) when none is given."""
DEFAULT_RESIDENCY = 0.45
"""Residency of a replay when none is given (the seed paper's headline point)."""
DEFAULT_RUNTIME_RESIDENCY = 0.3
"""Residency of an offloaded model when none is given."""
DEFAULT_RUNTIME_MISS = "auto"
"""How an offloaded model serves misses when not told, with control="inline": chosen per miss (faster
than copying every miss, simulated and live: docs/LOG.md). A posted decode step (control="thread")
copies by default (its host path is slower there on the CPU backend, and not yet measured on a GPU). The
simulator's protocol copies (`SimConfig.miss`)."""
DEFAULT_RESIDENCIES = (0.1, 0.25, 0.45, 0.65, 0.9)
"""Residencies of a sweep when none are given."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One replay of a trace by one system at one residency."""

    trace: str
    """Trace to replay: a saved .safetensors trace, a MoE-Beyond CSV folder or a Mixtral JSONL file/folder."""
    train: str | None = None
    """Training trace (learned statistics, start placement); default: split --trace by request."""
    test_fraction: float = 0.2
    """Without --train: the share of --trace's requests replayed (the rest trains)."""
    max_tokens: int | None = None
    """Replay only the first N tokens of the replayed trace (quick looks; default: all)."""
    model_profile: str = "deepseek-v2-lite"
    """Model profile: a preset name (see `seqmoe profiles`) or a .json/.toml file of its fields."""
    hardware: str = DEFAULT_HARDWARE
    """Hardware profile: a preset name (see `seqmoe profiles`) or a .json/.toml file of its fields."""
    residency: float = DEFAULT_RESIDENCY
    """Fraction of all experts the device pool holds, in (0, 1]."""
    system: str = DEFAULT_SYSTEM
    """Memory-management system (see `seqmoe systems`)."""
    predictor: str | None = None
    """Trained forecaster directory (`seqmoe train`) for the seqmoe systems; default: train one on --train (cached)."""
    miss: str = "copy"
    """How misses are served: copy (into a slot), in-place (read the host row over the link), cpu
    (compute on the host CPU; needs a hardware profile with a host) or auto (chosen per miss);
    cpu-all and static-split-style fix their own."""
    routing: str = ROUTINGS[0]
    """exact (the recorded routing) or cache-aware: a missing routed expert may be swapped for a resident
    one the router scored close to it, within --max-kl (the trace needs router_logits: `seqmoe trace
    collect --router-logits`)."""
    max_kl: float | None = None
    """Cache-aware routing's budget, nats of KL divergence per token."""
    seed: int = 0
    """Seed of the train/test split and of anything random in a system."""

    def __post_init__(self) -> None:
        check_residency(self.residency)
        check_miss(self.miss)
        check_routing(self.routing, self.max_kl)
        if not 0.0 < self.test_fraction < 1.0:
            raise UserError(f"--test-fraction must be in (0, 1), got {self.test_fraction}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"--max-tokens must be at least 1, got {self.max_tokens}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """12 hex digits identifying this configuration (goes into every result)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def add_config_flags(parser, cls, skip: tuple[str, ...] = ()) -> None:
    """Add one kebab-case flag per dataclass field, with its docstring as help."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = {"float": float, "int": int, "int | None": int, "float | None": float}.get(str(f.type), str)
        required = f.default is dataclasses.MISSING
        default = None if required else f.default
        suffix = "" if required or default is None else f" (default: {default})"
        parser.add_argument(flag, type=typ, default=default, required=required, help=docs.get(f.name, "") + suffix)


def config_from_args(cls, args, **overrides):
    """Build `cls` from parsed flags (fields only), then `overrides`."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)

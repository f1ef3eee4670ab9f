"""Model and hardware profiles for the cost model: expert sizes, bytes read per layer, link speeds.

A `ModelProfile` says how many bytes one routed expert occupies and how many other bytes a decode
token reads; a `HardwareProfile` says how fast host->device copies and HBM reads are. Together
they give the cost model of docs/DESIGN.md ("Evaluation protocol"): one copy takes
`alpha + expert_bytes / h2d`, and a batch-1 decode layer is bound by HBM bandwidth, taking
`bytes_read / (efficiency x peak)`. A prompt's forward is priced by its FLOPs too (`layer_flops`,
`device_flops_per_s`, ...; `seqmoe.sim.prefill`).

Presets are computed from each model's config.json in `seqmoe.costs.presets`, so the arithmetic is
visible; custom profiles load from a JSON or TOML file holding the dataclass fields::

    model = get_model_profile("deepseek-v2-lite")      # or get_model_profile("my_model.toml")
    hw = get_hardware_profile("h100-pcie5")
    copy_time_s(model, hw), layer_times_s(model, hw), full_load_token_s(model, hw)
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from seqmoe.base.errors import UserError
from seqmoe.costs.precision import check_precision, is_shipped, matrix_bytes, shipped_formats
from seqmoe.costs.presets import hardware_presets, model_presets

@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Sizes of one MoE model, as read by a batch-1 decode step."""

    name: str = "custom"
    """Profile name (a preset key, or free text for a custom file)."""
    num_layers: int
    """L: MoE layers (dense layers are counted in `token_bytes`)."""
    num_experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """K: routed experts each token uses per MoE layer."""
    expert_bytes: int
    """Bytes of one routed expert as stored and copied (all its matrices, scales and biases)."""
    layer_bytes: int = 0
    """Bytes read per MoE layer per decode token besides routed experts (attention, router, shared experts, norms)."""
    token_bytes: int = 0
    """Bytes read per decode token outside the MoE layers (dense layers, embedding row, lm_head)."""
    expert_params: int = 0
    """Weights of one routed expert's matrices, what a quantized store prices (0: expert_bytes / 2, a
    16-bit store); a prompt position computes 2 FLOPs per weight in each expert it routes to."""
    layer_flops: int = 0
    """FLOPs per position per MoE layer besides routed experts (2 x weights of attention, router, shared experts)."""
    token_flops: int = 0
    """FLOPs per position outside the MoE layers (dense layers; lm_head apart, in `head_flops`)."""
    head_flops: int = 0
    """FLOPs of the lm_head for one position (a prompt's forward computes it for its last position only)."""
    expert_shapes: tuple[tuple[int, int], ...] = ()
    """[outputs, inputs] of each weight matrix of one routed expert, as its checkpoint stores them (e.g.
    gate, up, down); what a shipped format (`seqmoe.costs.precision.SHIPPED`) is priced by, block by block.
    Empty: one matrix of `expert_params` weights (runtime precisions only)."""
    source: str = "user file"
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        what = f"model profile '{self.name}'"
        for f in ("num_layers", "num_experts", "top_k", "expert_bytes"):
            _check_number(what, f, getattr(self, f), integer=True, minimum=1)
        try:  # a file's lists become tuples (the profile stays hashable)
            shapes = tuple((int(a), int(b)) for a, b in self.expert_shapes)
        except (TypeError, ValueError):
            shapes = ()
        if len(shapes) != len(self.expert_shapes) or any(a < 1 or b < 1 for a, b in shapes):
            raise UserError(f"{what}: expert_shapes must be [outputs, inputs] pairs of positive integers, got "
                            f"{self.expert_shapes!r}")
        object.__setattr__(self, "expert_shapes", shapes)
        for f in ("layer_bytes", "token_bytes", "expert_params", "layer_flops", "token_flops", "head_flops"):
            _check_number(what, f, getattr(self, f), integer=True, minimum=0)
        if self.top_k > self.num_experts:
            raise UserError(f"{what}: top_k={self.top_k} exceeds num_experts={self.num_experts}")

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict (the format `get_model_profile` reads)."""
        return dataclasses.asdict(self)

    def at_precision(self, precision: str | None) -> ModelProfile:
        """This model with its experts stored at `precision` (`seqmoe.costs.precision`: a runtime format,
        or a shipped one priced by `expert_shapes`; vectors such as biases left out); itself for None."""
        if precision is None:
            return self
        check_precision(precision, shipped=True)
        shapes = self.expert_shapes or ((1, self.expert_params or self.expert_bytes // 2),)
        if is_shipped(precision) and not self.expert_shapes:
            raise UserError(f"model profile {self.name!r} gives no expert_shapes, which {precision} is priced by "
                            "(blocks of a matrix's inputs): add them to the profile, or choose int8, int4 or fp8")
        formats = shipped_formats(precision, len(shapes)) if is_shipped(precision) else (precision,) * len(shapes)
        return dataclasses.replace(self, name=f"{self.name} ({precision} experts)",
                                   expert_params=sum(a * b for a, b in shapes),
                                   expert_bytes=sum(matrix_bytes(a, b, f) for (a, b), f in zip(shapes, formats)))


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Speeds and capacity of one accelerator and its host link."""

    name: str = "custom"
    """Profile name (a preset key, or free text for a custom file)."""
    h2d_bytes_per_s: float
    """Effective pinned host->device copy bandwidth, bytes/s."""
    copy_overhead_s: float = 20e-6
    """alpha: fixed cost of one expert copy (launch, synchronisation), seconds."""
    hbm_bytes_per_s: float
    """Peak device memory (HBM/GDDR) bandwidth, bytes/s."""
    hbm_efficiency: float = 0.7
    """Fraction of peak memory bandwidth a batch-1 decode reaches, in (0, 1]."""
    device_memory_bytes: int
    """Device memory capacity, bytes."""
    host_memory_bytes_per_s: float | None = None
    """Peak host DRAM bandwidth (channels x MT/s x 8 bytes), bytes/s; None: no CPU miss path (`seqmoe.costs.host_cost`)."""
    host_cores: int | None = None
    """Host CPU cores that compute experts (with `host_memory_bytes_per_s`)."""
    device_flops_per_s: float | None = None
    """Peak dense bf16 FLOP/s of the accelerator (no sparsity); None: no prefill cost (`seqmoe.sim.prefill`)."""
    compute_efficiency: float = 0.5
    """Fraction of `device_flops_per_s` a prompt's GEMMs reach, in (0, 1]."""
    host_flops_per_s: float | None = None
    """bf16 FLOP/s the host's cores sustain in expert matmuls of many rows; None: the prompt path has no host CPU."""
    disk_bytes_per_s: float | None = None
    """Sustained read bandwidth of the disk holding the checkpoint for expert-sized reads, bytes/s;
    None: no disk tier (every expert in host memory)."""
    disk_latency_s: float = 80e-6
    """Fixed cost of one expert read from disk (NVMe read latency), seconds."""
    source: str = "user file"
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        what = f"hardware profile '{self.name}'"
        _check_number(what, "h2d_bytes_per_s", self.h2d_bytes_per_s, minimum=0, strict=True)
        _check_number(what, "copy_overhead_s", self.copy_overhead_s, minimum=0)
        _check_number(what, "hbm_bytes_per_s", self.hbm_bytes_per_s, minimum=0, strict=True)
        _check_number(what, "hbm_efficiency", self.hbm_efficiency, minimum=0, strict=True)
        if self.hbm_efficiency > 1:
            raise UserError(f"{what}: hbm_efficiency must be in (0, 1], got {self.hbm_efficiency}")
        _check_number(what, "device_memory_bytes", self.device_memory_bytes, integer=True, minimum=1)
        if (self.host_memory_bytes_per_s is None) != (self.host_cores is None):
            raise UserError(f"{what}: give host_memory_bytes_per_s and host_cores together (or neither: no CPU path)")
        for f in ("device_flops_per_s", "host_flops_per_s"):
            if getattr(self, f) is not None:
                _check_number(what, f, getattr(self, f), minimum=0, strict=True)
        _check_number(what, "compute_efficiency", self.compute_efficiency, minimum=0, strict=True)
        if self.compute_efficiency > 1:
            raise UserError(f"{what}: compute_efficiency must be in (0, 1], got {self.compute_efficiency}")
        if self.disk_bytes_per_s is not None:
            _check_number(what, "disk_bytes_per_s", self.disk_bytes_per_s, minimum=0, strict=True)
        _check_number(what, "disk_latency_s", self.disk_latency_s, minimum=0)
        if self.host_cores is not None:
            _check_number(what, "host_memory_bytes_per_s", self.host_memory_bytes_per_s, minimum=0, strict=True)
            _check_number(what, "host_cores", self.host_cores, integer=True, minimum=1)

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict (the format `get_hardware_profile` reads)."""
        return dataclasses.asdict(self)


def _check_number(what: str, field: str, value, *, integer: bool = False, minimum: float = 0,
                  strict: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise UserError(f"{what}: {field} must be {'an integer' if integer else 'a finite number'}, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise UserError(f"{what}: {field} must be {'>' if strict else '>='} {minimum}, got {value!r}")


# ---- cost model -------------------------------------------------------------------------------


def _hbm_rate(hw: HardwareProfile) -> float:
    return hw.hbm_efficiency * hw.hbm_bytes_per_s


def copy_time_s(model: ModelProfile, hw: HardwareProfile) -> float:
    """Seconds one expert copy occupies the copy engine: `alpha + expert_bytes / h2d`."""
    return hw.copy_overhead_s + model.expert_bytes / hw.h2d_bytes_per_s


def disk_read_s(model: ModelProfile, hw: HardwareProfile) -> float:
    """Seconds one expert read from disk occupies the disk: `latency + expert_bytes / disk bandwidth`
    (UserError for a profile without a disk)."""
    if hw.disk_bytes_per_s is None:
        raise UserError(f"hardware profile {hw.name!r} describes no disk: give disk_bytes_per_s (presets with one: "
                        f"{', '.join(n for n, h in HARDWARE_PROFILES.items() if h.disk_bytes_per_s)})")
    return hw.disk_latency_s + model.expert_bytes / hw.disk_bytes_per_s


def layer_times_s(model: ModelProfile, hw: HardwareProfile) -> tuple[float, float]:
    """Decode time of one MoE layer at batch 1, split as (non-expert seconds, seconds per routed expert)."""
    rate = _hbm_rate(hw)
    return model.layer_bytes / rate, model.expert_bytes / rate


def token_overhead_s(model: ModelProfile, hw: HardwareProfile) -> float:
    """Seconds per decode token spent outside the MoE layers (dense layers, lm_head)."""
    return model.token_bytes / _hbm_rate(hw)


def full_load_token_s(model: ModelProfile, hw: HardwareProfile) -> float:
    """Seconds per decode token with every expert resident: overhead + L x (non-expert + K x per-expert)."""
    non_expert, per_expert = layer_times_s(model, hw)
    return token_overhead_s(model, hw) + model.num_layers * (non_expert + model.top_k * per_expert)


MODEL_PROFILES: dict[str, ModelProfile] = {p["name"]: ModelProfile(**p) for p in model_presets()}
"""Model presets by name (their arithmetic and sources: `seqmoe.costs.presets`)."""
HARDWARE_PROFILES: dict[str, HardwareProfile] = {p["name"]: HardwareProfile(**p) for p in hardware_presets()}
"""Hardware presets by name."""


# ---- lookup -------------------------------------------------------------------------------------


def get_model_profile(name_or_path: str | Path) -> ModelProfile:
    """A preset by name (see `MODEL_PROFILES`), or a profile read from a .json/.toml file of its fields."""
    return _get(ModelProfile, MODEL_PROFILES, "model", name_or_path)


def get_hardware_profile(name_or_path: str | Path) -> HardwareProfile:
    """A preset by name (see `HARDWARE_PROFILES`), or a profile read from a .json/.toml file of its fields."""
    return _get(HardwareProfile, HARDWARE_PROFILES, "hardware", name_or_path)


def _get(cls, presets: dict, kind: str, name_or_path):
    key = str(name_or_path)
    if key in presets:
        return presets[key]
    path = Path(key)
    if path.suffix.lower() in (".json", ".toml"):
        if not path.is_file():
            raise UserError(f"{kind} profile file '{path}' not found")
        return _from_file(cls, kind, path)
    raise UserError(f"unknown {kind} profile '{key}'; choose one of: {', '.join(presets)}, or give a .json/.toml file")


def _from_file(cls, kind: str, path: Path):
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(path.read_text())
        else:
            data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"cannot read {kind} profile '{path}': {e}") from e
    if not isinstance(data, dict):
        raise UserError(f"{kind} profile '{path}' must hold a table/object of fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UserError(f"{kind} profile '{path}': unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    missing = [n for n, f in fields.items()
               if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise UserError(f"{kind} profile '{path}': missing required field(s) {', '.join(missing)}")
    data.setdefault("name", path.stem)
    # JSON writers often emit 1.7e7 for byte counts; accept whole floats where an int is expected.
    for n, v in data.items():
        if fields[n].type in ("int", "int | None") and isinstance(v, float) and v.is_integer():
            data[n] = int(v)
    return cls(**data)


LINKS = ("priced", "free")
"""How a copy to the device is priced: by the hardware profile, or not at all (`free_link`)."""
FREE_LINK_BYTES_PER_S = 1e30
"""The free link's bandwidth: finite so that every formula stays defined; a copy then takes ~1e-22 s."""


def free_link(hw: HardwareProfile) -> HardwareProfile:
    """`hw` with copies that cost nothing (no bandwidth limit, no per-copy overhead)."""
    return dataclasses.replace(hw, name=f"{hw.name}+free-link", h2d_bytes_per_s=FREE_LINK_BYTES_PER_S,
                               copy_overhead_s=0.0, source=f"{hw.source}; host link made free (--link free)")

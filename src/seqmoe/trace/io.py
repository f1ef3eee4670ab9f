"""Save and load routing traces: seqmoe's own safetensors files, and every importable format.

    trace = load_trace("shared/data/traces/deepseek-v2-lite-puffin")   # import a CSV folder
    save_trace(trace, "puffin.safetensors")                            # written atomically
    trace = load_trace("puffin.safetensors")                           # fast reload

`load_trace` accepts:
- a `.safetensors` file written by `save_trace`;
- a MoE-Beyond CSV file, or a folder with `*.csv` files at any depth (DeepSeek-V2-Lite);
- a Mixtral routing `.jsonl` file, or a folder with JSONL files at any depth: the files named
  `*_routing.jsonl` when there are any (so the speculative-moe folder imports
  `routing_data_collected/{gsm8k,humaneval}_2_routing.jsonl` and skips `*_outputs.jsonl` and the
  older `analysis/deep_analysis/routing_raw.jsonl`, which repeats humaneval problem 0 with
  prefill rows), otherwise every `*.jsonl` file.
Files with other extensions are recognised by their first bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from seqmoe.base.files import atomic_path
from seqmoe.trace.importers import files_under, import_mixtral_jsonl, import_moe_beyond_csv
from seqmoe.trace.schema import RoutingTrace, TraceError, TraceMeta

FORMAT = "seqmoe-trace"
VERSION = "1"
ACCEPTED = (
    "expected a .safetensors trace saved by seqmoe, a MoE-Beyond .csv file or folder, "
    "or a Mixtral routing .jsonl file or folder"
)
_CSV_HEADER_START = b"Layer ID,"


def save_trace(trace: RoutingTrace, path: str | os.PathLike) -> None:
    """Write `trace` to a safetensors file, whole or not at all.

    Tensors: `expert_ids` [T, L, K] int16, `request_offsets` [R + 1] int64, and when present
    `gate_weights` [T, L, K] float32, `token_ids` [T] int32, `pregate_logits` [T, L, H, E]
    float16 and `router_logits` [T, L, E] float32. String metadata: `format`,
    `version`, `meta` (TraceMeta fields as JSON) and, when present, `vocab` (JSON list).
    """
    with atomic_path(path) as tmp:
        write_trace_file(trace, tmp)


def write_trace_file(trace: RoutingTrace, path: str | os.PathLike) -> None:
    """Write `trace` to `path` directly (not atomic: callers wrap it in `atomic_path`)."""
    tensors = {
        "expert_ids": np.ascontiguousarray(trace.expert_ids, dtype=np.int16),
        "request_offsets": np.ascontiguousarray(trace.request_offsets, dtype=np.int64),
    }
    if trace.gate_weights is not None:
        tensors["gate_weights"] = np.ascontiguousarray(trace.gate_weights, dtype=np.float32)
    if trace.token_ids is not None:
        tensors["token_ids"] = np.ascontiguousarray(trace.token_ids, dtype=np.int32)
    if trace.pregate_logits is not None:
        tensors["pregate_logits"] = np.ascontiguousarray(trace.pregate_logits, dtype=np.float16)
    if trace.router_logits is not None:
        tensors["router_logits"] = np.ascontiguousarray(trace.router_logits, dtype=np.float32)
    metadata = {"format": FORMAT, "version": VERSION, "meta": json.dumps(dataclasses.asdict(trace.meta))}
    if trace.vocab is not None:
        metadata["vocab"] = json.dumps(list(trace.vocab), ensure_ascii=False)
    save_file(tensors, path, metadata=metadata)


def load_trace(path: str | os.PathLike, *, num_experts: int | None = None) -> RoutingTrace:
    """Load a saved trace or import one from any accepted format (see the module docstring).

    Args:
        path: a file or a folder.
        num_experts: E for imports (None: the importer's default, 64 for CSV, 8 for JSONL);
            for a saved trace it must match the stored E when given.

    Raises:
        TraceError: a missing path, an unrecognised format, or a malformed file.
    """
    path = Path(path)
    if not path.exists():
        raise TraceError(f"no such file or folder: {path}; {ACCEPTED}")
    kw = {} if num_experts is None else {"num_experts": num_experts}
    try:
        kind, target = _detect(path)
        if kind == "csv":
            return import_moe_beyond_csv(target, **kw)
        if kind == "jsonl":
            return import_mixtral_jsonl(target, **kw)
        trace = _read_trace_file(target)
    except OSError as e:
        raise TraceError(f"cannot read {e.filename or path}: {e.strerror or e}") from None
    if num_experts is not None and num_experts != trace.num_experts:
        raise TraceError(f"{path} holds a trace with {trace.num_experts} experts per layer, not {num_experts}")
    return trace


def _detect(path: Path) -> tuple[str, Path | list[Path]]:
    """("csv" | "jsonl" | "safetensors", what to pass to the loader)."""
    if path.is_dir():
        jsonl = files_under(path, "*_routing.jsonl") or files_under(path, "*.jsonl")
        has_csv = any(path.rglob("*.csv"))
        if jsonl and has_csv:
            raise TraceError(f"{path} holds both .csv and .jsonl files; point at the folder of one format")
        if has_csv:
            return "csv", path
        if jsonl:
            return "jsonl", jsonl
        raise TraceError(f"no .csv or .jsonl trace files under {path}; {ACCEPTED}")
    suffix = path.suffix.lower()
    if suffix in (".safetensors", ".csv", ".jsonl"):
        return suffix[1:], path
    with open(path, "rb") as fh:
        head = fh.read(4096)
    header_size = int.from_bytes(head[:8], "little")
    if len(head) >= 9 and head[8:9] == b"{" and 0 < header_size <= path.stat().st_size - 8:
        return "safetensors", path  # 8-byte little-endian header size, then the JSON header
    if head.lstrip(b"\xef\xbb\xbf").startswith(_CSV_HEADER_START):
        return "csv", path
    if head.lstrip().startswith(b"{"):
        return "jsonl", path
    raise TraceError(f"unrecognised trace file {path}; {ACCEPTED}")


def _read_trace_file(path: Path) -> RoutingTrace:
    try:
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise TraceError(f"{path}: not a readable safetensors file ({e}); {ACCEPTED}") from None
    if metadata.get("format") != FORMAT:
        raise TraceError(f"{path}: a safetensors file but not a seqmoe trace (format={metadata.get('format')!r})")
    if metadata.get("version") != VERSION:
        got = metadata.get("version")
        raise TraceError(f"{path}: trace format version {got!r}; this seqmoe reads version {VERSION}")
    missing = [name for name in ("expert_ids", "request_offsets") if name not in tensors]
    if missing or "meta" not in metadata:
        raise TraceError(f"{path}: trace file lacks {', '.join(missing) or 'meta'}")
    try:
        meta = TraceMeta(**json.loads(metadata["meta"]))
        vocab = tuple(json.loads(metadata["vocab"])) if "vocab" in metadata else None
    except (ValueError, TypeError) as e:
        raise TraceError(f"{path}: bad trace metadata ({e})") from None
    try:
        return RoutingTrace(
            expert_ids=tensors["expert_ids"],
            request_offsets=tensors["request_offsets"],
            meta=meta,
            gate_weights=tensors.get("gate_weights"),
            token_ids=tensors.get("token_ids"),
            vocab=vocab,
            pregate_logits=tensors.get("pregate_logits"),
            router_logits=tensors.get("router_logits"),
        )
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None

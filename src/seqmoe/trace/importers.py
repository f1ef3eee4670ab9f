"""Import routing traces recorded by other projects into a `RoutingTrace`.

- `import_moe_beyond_csv(path)`: MoE-Beyond DeepSeek-V2-Lite CSVs, one `prompt_N_data.csv` per
  request (a file, or a folder searched recursively, files in natural order: prompt_2 < prompt_10).
- `import_mixtral_jsonl(paths)`: speculative-moe Mixtral-8x7B JSONL records, one per
  (problem, layer, token).

Usually reached through `seqmoe.trace.io.load_trace(path)` or `seqmoe trace import SRC --out F`.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from seqmoe.trace._moe_beyond import ParsedRequest, parse_file
from seqmoe.trace.schema import RoutingTrace, TraceError, TraceMeta

_PROGRESS_MIN_FILES = 50  # fewer files import in well under a second: no bar


def natural_key(text: str) -> list:
    """Sort key that orders embedded integers by value: prompt_2 < prompt_10."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text))]


def files_under(path: Path, pattern: str) -> list[Path]:
    """Files matching `pattern` at any depth under `path`, in natural order of relative path."""
    files = [p for p in path.rglob(pattern) if p.is_file()]
    return sorted(files, key=lambda p: natural_key(p.relative_to(path).as_posix()))


# ----------------------------------------------------------------------------- MoE-Beyond CSV


def import_moe_beyond_csv(
    path: str | os.PathLike,
    *,
    num_experts: int = 64,
    model: str = "deepseek-v2-lite",
    progress: bool | None = None,
) -> RoutingTrace:
    """Import MoE-Beyond routing CSVs (one request per file).

    Args:
        path: a `prompt_N_data.csv` file, or a folder holding them at any depth; files are taken
            in natural order of their relative path (by N, not lexically).
        num_experts: E, routed experts per layer (64 for DeepSeek-V2-Lite).
        model: model name recorded in the trace's meta.
        progress: show a tqdm bar on stderr when it is a terminal; None: only for 50+ files.

    Returns:
        A trace with expert_ids [T, L, K] int16 (CSV layer ids 1..L become 0..L-1),
        token_ids [T] int32 indexing `vocab` (token strings in order of first appearance), and
        `meta.extra["request_names"]`, the file of each request.

    Raises:
        TraceError: a missing path, an empty folder, or a malformed file (file name and line).
    """
    if not 1 <= num_experts <= np.iinfo(np.int16).max:
        raise TraceError(f"num_experts must be in [1, 32767] (ids are stored as int16), got {num_experts}")
    path = Path(path)
    if path.is_dir():
        files = files_under(path, "*.csv")
        if not files:
            raise TraceError(f"no .csv files under {path}; expected MoE-Beyond prompt_N_data.csv files")
        root = path
    elif path.is_file():
        files, root = [path], path.parent
    else:
        raise TraceError(f"no such file or folder: {path}")
    show = len(files) >= _PROGRESS_MIN_FILES if progress is None else progress
    parsed = _parse_files(files, num_experts, show)
    names = [f.relative_to(root).as_posix() for f in files]
    return _stack_csv_requests(parsed, names, num_experts, model, str(path))


def _parse_files(files: list[Path], num_experts: int, show: bool) -> list[ParsedRequest]:
    def parse(f: Path) -> ParsedRequest:
        return parse_file(f.read_bytes(), str(f), num_experts)

    # numpy releases the GIL in most of the fast path, so threads help; map keeps file order
    # and raises the first failing file's error.
    pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(files)))
    try:
        results = pool.map(parse, files)
        return list(tqdm(results, total=len(files), desc="import csv", unit="file", disable=None if show else True))
    finally:
        pool.shutdown(cancel_futures=True)  # after an error, skip the files not started yet


def _stack_csv_requests(
    parsed: list[ParsedRequest], names: list[str], num_experts: int, model: str, source: str
) -> RoutingTrace:
    """Concatenate per-file requests after checking they share L and K."""
    _, num_layers, top_k = parsed[0].expert_ids.shape
    for p, name in zip(parsed, names):
        if p.expert_ids.shape[1:] != (num_layers, top_k):
            raise TraceError(
                f"{name}: {p.expert_ids.shape[1]} layers x {p.expert_ids.shape[2]} experts per token, "
                f"but {names[0]} has {num_layers} x {top_k}"
            )
    vocab: dict[str, int] = {}
    token_ids = np.array([vocab.setdefault(t, len(vocab)) for p in parsed for t in p.tokens], dtype=np.int32)
    lengths = [len(p.tokens) for p in parsed]
    return RoutingTrace(
        expert_ids=np.concatenate([p.expert_ids for p in parsed]),
        request_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        meta=TraceMeta(
            model=model,
            num_experts=num_experts,
            source=f"moe-beyond-csv:{source}",
            extra={"request_names": names},
        ),
        token_ids=token_ids,
        vocab=tuple(vocab),
    )


# ----------------------------------------------------------------------------- Mixtral JSONL

_REQUIRED = ("dataset", "problem_id", "layer", "experts", "gating_probs")


def import_mixtral_jsonl(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    num_experts: int = 8,
    model: str = "mixtral-8x7b",
) -> RoutingTrace:
    """Import speculative-moe Mixtral routing JSONL files.

    Each line is `{"dataset", "problem_id", "layer", "experts": [K], "gating_probs": [K],
    "token_idx" | "token_pos"}`. One request per (dataset, problem_id), in order of first
    appearance; within a layer, rows are taken in file order (the token index is not used). The
    recorder dropped some rows, so a request's layers can hold a few tokens more or less: every
    layer is cut to the request's shortest layer (a `UserWarning` says how many rows went), and
    `meta.extra` records `dropped_rows` and `dropped_rows_per_request`.

    Args:
        paths: one JSONL file or several; a request must not span files.
        num_experts: E (8 for Mixtral-8x7B).
        model: model name recorded in the trace's meta.

    Returns:
        A trace with expert_ids [T, L, K] int16 and gate_weights [T, L, K] float32, and
        `meta.extra["request_names"]` ("dataset/problem_id" per request).

    Raises:
        TraceError: malformed JSON or records (file and line), missing layers, or a request in two files.
    """
    paths = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not paths:
        raise TraceError("no JSONL files given")
    requests: dict[tuple[str, str], dict[int, list]] = {}
    home: dict[tuple[str, str], Path] = {}
    top_k = None
    for path in paths:
        if not path.is_file():
            raise TraceError(f"no such file: {path}")
        for where, rec in _records(path):
            ids, probs, layer = _check_record(rec, where, num_experts, top_k)
            top_k = len(ids)
            key = (str(rec["dataset"]), str(rec["problem_id"]))
            if home.setdefault(key, path) != path:
                raise TraceError(f"{where}: request {key[0]}/{key[1]} also appears in {home[key]}")
            requests.setdefault(key, {}).setdefault(layer, []).append((ids, probs))
    if not requests:
        raise TraceError(f"no routing records in {', '.join(map(str, paths))}")
    return _stack_jsonl_requests(requests, num_experts, model, paths)


def _records(path: Path):
    """Yield ("file:line", record) for every non-blank line."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(f"{path}:{lineno}: not UTF-8 text (byte {e.start} of the line); expected Mixtral "
                                 "routing JSONL") from None
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise TraceError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
            yield where, rec


def _check_record(rec: dict, where: str, num_experts: int, top_k: int | None) -> tuple[list, list, int]:
    missing = [k for k in _REQUIRED if k not in rec]
    if missing:
        raise TraceError(f"{where}: record lacks {', '.join(missing)}; expected keys {', '.join(_REQUIRED)}")
    ids, probs, layer = rec["experts"], rec["gating_probs"], rec["layer"]
    if not isinstance(layer, int) or layer < 0:
        raise TraceError(f"{where}: layer must be a non-negative integer, got {layer!r}")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise TraceError(f"{where}: experts must be a non-empty list of integers, got {ids!r}")
    if top_k is not None and len(ids) != top_k:
        raise TraceError(f"{where}: {len(ids)} experts, but earlier records have {top_k}")
    bad = [i for i in ids if not 0 <= i < num_experts]
    if bad:
        raise TraceError(f"{where}: expert id {bad[0]} out of range [0, {num_experts})")
    if len(set(ids)) != len(ids):
        raise TraceError(f"{where}: an expert appears twice in {ids}")
    if not isinstance(probs, list) or len(probs) != len(ids) or not all(isinstance(p, (int, float)) for p in probs):
        raise TraceError(f"{where}: gating_probs must be {len(ids)} numbers, got {probs!r}")
    return ids, probs, layer


def _stack_jsonl_requests(
    requests: dict[tuple[str, str], dict[int, list]], num_experts: int, model: str, paths: list[Path]
) -> RoutingTrace:
    num_layers = 1 + max(max(layers) for layers in requests.values())
    ids_parts, prob_parts, lengths, dropped = [], [], [], []
    for (dataset, problem), layers in requests.items():
        absent = [layer for layer in range(num_layers) if layer not in layers]
        if absent:
            raise TraceError(
                f"request {dataset}/{problem} has no records for layer {absent[0]} (layers 0..{num_layers - 1} seen)"
            )
        counts = [len(layers[layer]) for layer in range(num_layers)]
        t = min(counts)
        dropped.append(sum(counts) - t * num_layers)
        rows = [layers[layer][:t] for layer in range(num_layers)]  # [L][T] of (ids, probs)
        ids_parts.append(np.array([[r[0] for r in rs] for rs in rows], dtype=np.int16).transpose(1, 0, 2))
        prob_parts.append(np.array([[r[1] for r in rs] for rs in rows], dtype=np.float32).transpose(1, 0, 2))
        lengths.append(t)
    if sum(dropped):
        warnings.warn(
            f"{sum(dropped)} routing rows dropped: layers of {sum(d > 0 for d in dropped)} request(s) had unequal "
            "token counts, so each request was cut to its shortest layer",
            stacklevel=3,
        )
    return RoutingTrace(
        expert_ids=np.ascontiguousarray(np.concatenate(ids_parts)),
        request_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        gate_weights=np.ascontiguousarray(np.concatenate(prob_parts)),
        meta=TraceMeta(
            model=model,
            num_experts=num_experts,
            source="mixtral-jsonl:" + ",".join(str(p) for p in paths),
            extra={
                "request_names": [f"{d}/{p}" for d, p in requests],
                "dropped_rows": int(sum(dropped)),
                "dropped_rows_per_request": [int(d) for d in dropped],
            },
        ),
    )

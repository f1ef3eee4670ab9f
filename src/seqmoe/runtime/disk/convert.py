"""`convert`: a checkpoint written once with its routed experts in seqmoe's quantized rows.

    report = convert("models/bf16", "models/int4", "int4")   # DST appears whole, or not at all
    model, runtime = seqmoe.load("models/int4", host_memory="8GiB")   # streams the int4 bytes

DST holds the source's other files (config.json, tokenizer, ...), its dense tensors unchanged
(`model-dense.safetensors`), each MoE layer's routed experts as one [E, B] uint8 tensor of
`QuantLayout` rows, or `ShippedLayout` rows for a shipped format's layout (`experts-LLLLL.safetensors`,
key `{experts module path}.seqmoe_rows`), a
`model.safetensors.index.json` over them, and `seqmoe_experts.json` (format, precision, dtype).
The format is in docs/DESIGN.md ("Converted checkpoints").

The folder is written under a hidden sibling (`.DST.partial`) and renamed into place at the end:
an error removes it, and a killed convert leaves only that hidden folder, which the next convert to
the same DST removes first. Memory: the dense part, plus one layer's rows.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from seqmoe.arch import model_arch
from seqmoe.arch.model_dirs import resolve_model_dir
from seqmoe.arch.quant import CONVERTED, CONVERTED_FORMAT, ROWS_SUFFIX, converted_precision, store_layout
from seqmoe.arch.shipped import shipped_precision
from seqmoe.base.errors import UserError
from seqmoe.costs.precision import check_precision
from seqmoe.runtime.disk.checkpoint import ExpertFiles
from seqmoe.runtime.disk.index import INDEX, SINGLE, CheckpointIndex
from seqmoe.runtime.disk.reader import DiskReader
from seqmoe.runtime.disk.skeleton import meta_model

DENSE = "model-dense.safetensors"
CHUNK = 16
"""Experts quantized together (one batch of `pack_rows`)."""


@dataclass(frozen=True)
class ConvertReport:
    folder: str
    precision: str
    expert_bytes_before: int
    """The routed experts' bytes in the source's files."""
    expert_bytes_after: int
    dense_bytes: int


def convert(src, dst, precision: str, *, requantize: bool = False, progress: bool = False) -> ConvertReport:
    """Write `src`'s checkpoint to the new folder `dst` with its routed experts at `precision` (int8, int4,
    fp8); UserError for a bad precision, a `dst` that exists, or a source that does not load. A source
    shipped quantized (FP8 blocks, MXFP4, GPTQ) is decoded and rounded again only with `requantize`."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    check_precision(precision, shipped=True)
    if precision is None:
        raise UserError("give an expert precision to convert to (int8, int4, fp8, or a shipped format)")
    src, dst = resolve_model_dir(src), Path(dst)  # a folder, or a packaged model's name (seqmoe-tiny)
    if converted_precision(src) is not None:
        raise UserError(f"{src} was written by seqmoe convert already; convert the original checkpoint")
    if dst.exists():
        raise UserError(f"{dst} exists; convert writes a new folder and never overwrites one: give another path")
    shipped = shipped_precision(src)
    if shipped is not None and not requantize:
        raise UserError(f"{src} ships its experts as {shipped}: converting them to {precision} rounds them a second "
                        f"time; pass --requantize (requantize=True) to do it anyway, or load the checkpoint as it is "
                        "(seqmoe.load, generate and serve keep its codes)")
    model, paths, base = meta_model(src)
    layout, E = store_layout(base, precision), model_arch(model).num_experts
    source = store_layout(base, shipped)  # the experts' rows as the files hold them
    index = CheckpointIndex.open(src)
    files = ExpertFiles.open(src, paths, source, E, index=index)
    tmp = dst.parent / f".{dst.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed convert left
    try:
        tmp.mkdir(parents=True)
        _copy_other_files(src, tmp)
        dense = _dense(index, files.expert_keys)
        save_file(dense, tmp / DENSE)
        weight_map = dict.fromkeys(dense, DENSE)
        dense_bytes = sum(t.nbytes for t in dense.values())
        del dense
        before = after = 0
        rows = torch.empty((E, layout.numel), dtype=torch.uint8)
        scratch = torch.empty((CHUNK, source.numel), dtype=source.dtype)
        for layer in tqdm(range(len(paths)), desc=f"convert to {precision}", unit="layer", disable=not progress):
            for start in range(0, E, CHUNK):
                n = min(CHUNK, E - start)
                for i in range(n):
                    files.read_into(layer, start + i, scratch[i])
                    before += files.expert_nbytes(layer, start + i)
                layout.pack_views(source.views(scratch[:n]), rows[start:start + n])
            name, key = f"experts-{layer:05d}.safetensors", f"{paths[layer]}.{ROWS_SUFFIX}"
            save_file({key: rows}, tmp / name)
            weight_map[key] = name
            after += rows.nbytes
        total = dense_bytes + after
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / CONVERTED).write_text(json.dumps({"format": CONVERTED_FORMAT, "precision": precision,
                                                 "dtype": str(base.dtype).removeprefix("torch."),
                                                 "source": str(src)}, indent=1))
        files.close()
        os.rename(tmp, dst)  # atomic on one file system; fails if dst appeared meanwhile
    except BaseException:
        files.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertReport(str(dst), precision, before, after, dense_bytes)


def _dense(index: CheckpointIndex, expert_keys: set[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the source but the routed experts', read whole."""
    reader, handles = DiskReader(None), {}
    try:
        return {k: index.read_tensor(k, reader, handles).contiguous() for k in index.tensors if k not in expert_keys}
    finally:
        for f in handles.values():
            reader.close(f)


def _copy_other_files(src: Path, dst: Path) -> None:
    """Everything in `src` but its safetensors files and their index (config, tokenizer, generation config)."""
    for item in src.iterdir():
        if item.name.endswith(".safetensors") or item.name in (INDEX, SINGLE):
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name)
        else:
            shutil.copy2(item, dst / item.name)

"""The tensors of a safetensors checkpoint folder, from the files' headers only.

    index = CheckpointIndex.open(folder)     # model.safetensors, or the shards of model.safetensors.index.json
    entry = index.tensors["model.norm.weight"]   # TensorEntry: file, dtype, shape, absolute offset, nbytes
    index.check_file(entry.file, "layer 3 expert 17")   # CheckpointChanged if the file changed since open
    t = index.read_tensor("model.norm.weight", reader)  # one tensor, read with a DiskReader

A safetensors file is an 8-byte little-endian header length, a JSON header of
{key: {dtype, shape, data_offsets: [begin, end]}} and the data; a tensor's absolute offset is
8 + header length + begin. Each file's (size, mtime_ns, inode) is kept from open so that a file
rewritten, replaced or truncated later is refused instead of read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from seqmoe.arch.shipped import shipped_precision
from seqmoe.runtime.disk.reader import DiskReader, ShortRead
from seqmoe.base.errors import UserError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit: a larger "length" means the file is not safetensors


class CheckpointChanged(UserError):
    """A checkpoint file is missing, truncated or changed since the model was loaded."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: file number (in `CheckpointIndex.paths`), dtype, shape, absolute byte range."""

    file: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute offset of its first byte in the file."""
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


class CheckpointIndex:
    """The tensors of one checkpoint folder and the identity of each of its files at open."""

    def __init__(self, folder: Path, paths: list[Path], stats: list[tuple[int, int, int]],
                 tensors: dict[str, TensorEntry]):
        self.folder, self.paths, self.stats, self.tensors = folder, paths, stats, tensors

    @classmethod
    def open(cls, folder) -> CheckpointIndex:
        """Read the headers of `folder`'s safetensors files; UserError for a missing or malformed file
        or a checkpoint quantized in a format seqmoe does not read."""
        folder = Path(folder)
        shipped_precision(folder)
        paths = _shard_paths(folder)
        stats, tensors = [], {}
        for i, path in enumerate(paths):
            try:
                stats.append(_stat_key(os.stat(path)))
            except FileNotFoundError:
                raise UserError(f"checkpoint file {path} is missing (listed in {folder / INDEX})") from None
            for key, entry in _read_header(path, i).items():
                tensors[key] = entry
        return cls(folder, paths, stats, tensors)

    def check_file(self, i: int, what: str = "") -> None:
        """CheckpointChanged if file `i` is missing or differs in size, mtime or inode from open."""
        path = self.paths[i]
        about = f" while reading {what}" if what else ""
        try:
            now = _stat_key(os.stat(path))
        except FileNotFoundError:
            raise CheckpointChanged(f"checkpoint file {path} is missing{about}; it was there when the model "
                                    "was loaded: restore it and reload the model") from None
        if now != self.stats[i]:
            size0, size1 = self.stats[i][0], now[0]
            how = f"truncated ({size0} -> {size1} bytes)" if size1 < size0 else "changed"
            raise CheckpointChanged(f"checkpoint file {path} was {how} since the model was loaded{about}; "
                                    "reload the model")

    def check(self) -> None:
        """CheckpointChanged unless every file is as it was at open."""
        for i in range(len(self.paths)):
            self.check_file(i)

    def read_tensor(self, key: str, reader: DiskReader, files: dict | None = None) -> torch.Tensor:
        """Tensor `key` read from disk (a new CPU tensor of the checkpoint's dtype and shape).
        `files` caches open ReadFiles by file number across calls (the caller closes them)."""
        entry = self.tensors[key]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        if entry.nbytes == 0:
            return out
        files = {} if files is None else files
        if entry.file not in files:
            files[entry.file] = reader.open(self.paths[entry.file])
        self.check_file(entry.file, f"tensor {key}")
        try:
            reader.read_into(files[entry.file], entry.offset, [memoryview(out.view(-1).view(torch.uint8).numpy())])
        except ShortRead:
            raise CheckpointChanged(f"checkpoint file {self.paths[entry.file]} ends before tensor {key}; it was "
                                    "truncated since the model was loaded: reload the model") from None
        return out


def _shard_paths(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index} has no weight_map; not a transformers sharded checkpoint index")
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    raise UserError(f"{folder} has neither {SINGLE} nor {INDEX}; give a folder saved by save_pretrained "
                    "(safetensors)")


def _read_header(path: Path, file: int) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (UserError if its header is malformed)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= _MAX_HEADER:
            raise UserError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise UserError(f"{path} has a malformed safetensors header: {e}") from None
    base, out = 8 + n, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise UserError(f"{path}: tensor {key} has dtype {info.get('dtype')!r}, which seqmoe cannot read")
        begin, end = info["data_offsets"]
        out[key] = TensorEntry(file, dtype, tuple(info["shape"]), base + begin, end - begin)
    return out

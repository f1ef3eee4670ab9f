"""`ExpertFiles`: each routed expert's bytes in the checkpoint's safetensors files, read into a packed row.

    files = ExpertFiles.open(folder, experts_paths, layout, num_experts)
    files.read_into(layer, e, out)    # out [P] of layout.dtype: what layout.pack gives for the loaded model
    files.expert_nbytes(layer, e)     # bytes one read_into takes from disk
    files.check(); files.expert_keys; files.close()

`layer` counts MoE layers (the order of `experts_paths`, i.e. `arch.moe`). An experts module holds
stacked parameters (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], ...); checkpoints store them
either the same way (fused, GPT-OSS: expert e is one contiguous slice of each) or per expert in the
original format (`{prefix}.{e}.gate_proj.weight` + `up_proj` concatenated along dim 0 give
`gate_up_proj`; Mixtral calls them w1, w3, w2 under `block_sparse_moe`). Each expert's byte ranges
are planned once at open, ranges adjacent in a file merged into one read. A checkpoint shipped quantized
(a `ShippedLayout`) is read as its own tensors, each into its place in the row (`_shipped_plan`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from seqmoe.arch.layout import ExpertLayout
from seqmoe.arch.quant import ROWS_SUFFIX, QuantLayout, converted_precision, stored_precision
from seqmoe.arch.shipped import SHIPPED_CODECS
from seqmoe.arch.shipped_layout import ShippedLayout
from seqmoe.runtime.disk.index import CheckpointChanged, CheckpointIndex
from seqmoe.runtime.disk.reader import DiskReader, ShortRead
from seqmoe.base.errors import UserError

__all__ = ["CheckpointChanged", "ExpertFiles", "checkpoint_keys"]

RENAMES: tuple[tuple[str, str], ...] = ((".mlp.", ".block_sparse_moe."),)
"""(in the model, in the checkpoint) module-path renames tried when the exact path is absent:
Mixtral's (and MiniMax's) MoE block is saved as `block_sparse_moe` (transformers' conversion_mapping)."""
_PER_EXPERT = {"gate_up_proj": (("gate_proj", "w1"), ("up_proj", "w3")), "down_proj": (("down_proj", "w2"),)}
"""A stacked parameter -> the per-expert linears concatenated along dim 0 to make it, each with its aliases."""


@dataclass(frozen=True)
class _Piece:
    """One checkpoint tensor's share of an expert: `nbytes` at `rel` in its read -> row[dest:dest+numel]."""

    rel: int
    nbytes: int
    dtype: torch.dtype
    dest: int
    numel: int
    into: torch.dtype | None = None
    """The dtype the row holds this piece in, from byte `dest` (None: the row's own, `dest` in its elements)."""


@dataclass(frozen=True)
class _Read:
    """One request to one file: `nbytes` from absolute `offset`, split into pieces in file order."""

    file: int
    offset: int
    nbytes: int
    pieces: tuple[_Piece, ...]


def checkpoint_keys(name: str) -> list[str]:
    """`name` (a model parameter or module path), then its forms under `RENAMES`: the checkpoint keys to try."""
    return [name] + [name.replace(m, c) for m, c in RENAMES if m in name]


def _has_prefix(index: CheckpointIndex, prefix: str) -> bool:
    """Whether some key of `index` lies under module `prefix` (the set of prefixes built once per index)."""
    prefixes = index.__dict__.get("_prefixes")
    if prefixes is None:
        prefixes = {k.rsplit(".", j)[0] for k in index.tensors for j in range(1, k.count(".") + 1)}
        index.__dict__["_prefixes"] = prefixes
    return prefix in prefixes


class ExpertFiles:
    """Packed rows of the routed experts, read from the checkpoint on demand (thread-safe)."""

    def __init__(self, index: CheckpointIndex, reader: DiskReader, plans: list[list[tuple[_Read, ...]]],
                 layout: ExpertLayout, experts_paths: tuple[str, ...], expert_keys: set[str]):
        self.index, self.reader, self.layout = index, reader, layout
        self.experts_paths, self.expert_keys = experts_paths, expert_keys
        self._plans = plans
        self._files = [reader.open(p) for p in index.paths]
        self._digests: dict[tuple[int, int], int] = {}  # (layer, expert) -> crc32 of its row at its first read

    @classmethod
    def open(cls, folder, experts_paths, layout: ExpertLayout, num_experts: int, *,
             mode: str | None = None, index: CheckpointIndex | None = None) -> ExpertFiles:
        """Map every expert of every layer from `folder`'s headers; UserError for a part not found or
        shaped unlike `layout`, a quantization seqmoe does not read, or a layout other than the one the
        folder stores. `mode`: the DiskReader's ("direct", "buffered")."""
        index = index or CheckpointIndex.open(Path(folder))
        stored = stored_precision(index.folder)
        if getattr(layout, "precision", None) != stored:  # another layout would misread the files' codes
            raise UserError(f"{index.folder} stores its experts as {stored or 'the model dtype'}, not as "
                            f"{getattr(layout, 'precision', None) or 'the model dtype'}: open them with "
                            "seqmoe.arch.quant.store_layout(layout, stored_precision(folder)), as seqmoe.load does")
        plans, keys = [], set()
        if converted_precision(index.folder):  # a converted checkpoint: its rows as the store keeps them
            plans = [_rows_plans(index, layout, layer, path, num_experts, keys) for layer, path in enumerate(experts_paths)]
        plan = _shipped_plan if isinstance(layout, ShippedLayout) else _plan
        if getattr(index, "gguf", None) is not None:  # a GGUF file: its own tensor names
            plans = [[_gguf_plan(index, layout, layer, path, e, keys) for e in range(num_experts)]
                     for layer, path in enumerate(experts_paths)]
        for layer, path in enumerate(experts_paths if not plans else ()):
            prefix = _experts_prefix(index, path)
            plans.append([plan(index, layout, layer, path, prefix, e, num_experts, keys) for e in range(num_experts)])
        return cls(index, DiskReader(mode), plans, layout, tuple(experts_paths), keys)

    @property
    def num_layers(self) -> int:
        return len(self._plans)

    @property
    def num_experts(self) -> int:
        return len(self._plans[0])

    @property
    def bytes_read(self) -> int:
        """Bytes read from disk since open, all threads together."""
        return sum(f.bytes_read for f in self._files)

    def expert_nbytes(self, layer: int, e: int) -> int:
        """Bytes `read_into(layer, e, ...)` reads from disk (the merged ranges)."""
        return sum(r.nbytes for r in self._plans[layer][e])

    def read_into(self, layer: int, e: int, out: torch.Tensor) -> None:
        """Fill `out` [P] (layout.dtype, contiguous, CPU) with expert `e` of MoE layer `layer`, packed as
        `layout.pack` packs it. CheckpointChanged if a file is missing, truncated or changed since open."""
        L = self.layout
        if out.shape != (L.numel,) or out.dtype != L.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"out must be a contiguous CPU [{L.numel}] {L.dtype} tensor, got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
        what = f"layer {layer} expert {e} ({self.experts_paths[layer]})"
        row = out.view(torch.uint8).numpy()
        for r in self._plans[layer][e]:
            self.index.check_file(r.file, what)
            try:
                self._read(r, out, row)
            except ShortRead:
                raise CheckpointChanged(f"checkpoint file {self.index.paths[r.file]} ends before the bytes of "
                                        f"{what}: it was truncated since the model was loaded; reload the model") from None
            except FileNotFoundError:
                raise CheckpointChanged(f"checkpoint file {self.index.paths[r.file]} is missing while reading "
                                        f"{what}; reload the model") from None
            self.index.check_file(r.file, what)  # changed during the read: the bytes may mix old and new
        # A file rewritten in place with its size, inode and mtime put back passes check_file; its bytes do not.
        digest = zlib.crc32(row)
        if self._digests.setdefault((layer, e), digest) != digest:
            raise CheckpointChanged(f"the bytes of {what} differ from those read at its first read: a checkpoint file "
                                    "was rewritten in place since the model was loaded; reload the model")

    def _read(self, r: _Read, out: torch.Tensor, row) -> None:
        f, isz = self._files[r.file], out.element_size()
        if _direct_ok(r, out.dtype):  # same dtype, no gaps: scatter straight into the row
            views = [memoryview(row[p.dest * isz:(p.dest + p.numel) * isz]) for p in r.pieces]
            self.reader.read_into(f, r.offset, views)
            return
        buf = self.reader.read(f, r.offset, r.nbytes)
        for p in r.pieces:  # convert (bf16 on disk -> fp32 model, ...) or skip gaps between pieces
            dst = out[p.dest:p.dest + p.numel] if p.into is None else \
                out[p.dest:p.dest + p.numel * p.into.itemsize].view(p.into)
            convert_into(buf[p.rel:p.rel + p.nbytes], p.dtype, dst)

    def check(self) -> None:
        """CheckpointChanged unless every checkpoint file is unchanged since open."""
        self.index.check()

    def close(self) -> None:
        for f in self._files:
            self.reader.close(f)
        self._files = []

    def __enter__(self) -> ExpertFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def convert_into(buf: memoryview, dtype: torch.dtype, dst: torch.Tensor) -> None:
    """Write the numbers `buf` holds as `dtype` into `dst` (1-D, contiguous), converted to its dtype.
    numpy where it can: single-threaded without the GIL, where torch's copy_ would split the work over
    its intra-op threads, contending with the model thread (and 10x slower on a busy 2-core machine)."""
    if dtype == torch.bfloat16 and dst.dtype == torch.float32:  # bf16 is the top half of an fp32: exact
        np.left_shift(np.frombuffer(buf, dtype=np.uint16), 16, dtype=np.uint32,
                      out=dst.view(torch.int32).numpy().view(np.uint32))
    elif dtype == dst.dtype:
        np.copyto(dst.view(torch.uint8).numpy(), np.frombuffer(buf, dtype=np.uint8))
    elif dtype in _NUMPY and dst.dtype in _NUMPY:
        np.copyto(dst.numpy(), np.frombuffer(buf, dtype=_NUMPY[dtype]), casting="unsafe")
    else:  # e.g. fp32 on disk -> bf16 rows: torch's rounding (what from_pretrained's .to() gives)
        dst.copy_(torch.frombuffer(buf, dtype=dtype))


def _direct_ok(r: _Read, dtype: torch.dtype) -> bool:
    at = 0
    for p in r.pieces:
        if p.dtype != dtype or p.rel != at or p.into is not None:
            return False
        at += p.nbytes
    return at == r.nbytes


def _experts_prefix(index: CheckpointIndex, path: str) -> str:
    """The checkpoint's name for the experts module at `path` (the first candidate with keys under it)."""
    for cand in checkpoint_keys(path):
        if _has_prefix(index, cand):
            return cand
    tried = ", ".join(checkpoint_keys(path))
    raise UserError(f"the checkpoint in {index.folder} has no tensors under the routed experts module {path} "
                    f"(tried {tried}); it was not saved from this model")


def _plan(index, layout, layer, path, prefix, e, E, keys) -> tuple[_Read, ...]:
    """The merged reads of expert `e`: every layout part located, checked against its shape, then the
    parts sorted by file position and adjacent ones joined."""
    parts = []  # (file, offset, nbytes, dtype, dest, numel, into)
    for name, shape, dest in zip(layout.names, layout.shapes, layout.offsets):
        for key, entry, off, numel in _locate(index, layer, path, prefix, e, E, name, shape):
            keys.add(key)
            parts.append((entry.file, off, numel * entry.dtype.itemsize, entry.dtype, dest, numel, None))
            dest += numel
    return _merged(parts)


_FILE_SUFFIX = {("mxfp4", "blocks"): ("blocks", "weight"), ("mxfp4", "scales"): ("scales", "weight_scale_inv")}
"""A codec tensor's per-expert names in files: FP8 checkpoints that pack their experts as FP4 store the codes
as `weight` ([rows, cols / 2] int8) and the E8M0 exponents as `weight_scale_inv` (transformers reads them so)."""


def _shipped_plan(index, layout: ShippedLayout, layer, path, prefix, e, E, keys) -> tuple[_Read, ...]:
    """The reads of expert `e` of a checkpoint shipped in `layout.precision`: each file tensor of each
    linear (`{prefix}.{e}.gate_proj.weight_scale_inv`, ...; fused `{prefix}.gate_up_proj_blocks` [E, ...]
    as gpt-oss stores them) into its place in the row; scales of another float dtype converted, vectors
    to the model's dtype."""
    parts = []
    for name, k, r, c, f in layout.matrices:
        aliases = _PER_EXPERT[name][k] if name in _PER_EXPERT and not layout.base.in_out else (name,)
        for suffix, (shape, dtype) in SHIPPED_CODECS[f].tensors(r, c).items():
            dest = layout.part(name, k, suffix)[0]
            fused = f"{prefix}.{name}_{suffix}"
            cands = [f"{prefix}.{e}.{a}.{s}" for a in aliases for s in _FILE_SUFFIX.get((f, suffix), (suffix,))]
            key = next((x for x in [fused, *cands] if x in index.tensors), None)
            if key is None:
                raise UserError(f"the {layout.precision} checkpoint in {index.folder} has no {suffix} of {name} for "
                                f"layer {layer} expert {e} ({path}): tried {', '.join([fused, *cands])}")
            entry, numel = index.tensors[key], math.prod(shape)
            if key == fused or entry.numel != numel:  # per-expert FP4 codes are [rows, cols / 2]: the same bytes
                _check_shape(index, key, entry.shape, (E, *shape) if key == fused else shape, layer, path, e, name)
            off = entry.offset + (e * numel * entry.dtype.itemsize if key == fused else 0)
            keys.add(key)
            if entry.dtype.itemsize == dtype.itemsize and not (entry.dtype.is_floating_point or dtype.is_floating_point) \
                    or entry.dtype == dtype:  # the codes and scales as stored (int8 or uint8 alike): bytes into the row
                parts.append((entry.file, off, numel * dtype.itemsize, torch.uint8, dest, numel * dtype.itemsize, None))
            elif entry.dtype.is_floating_point and dtype.is_floating_point:  # e.g. bf16 scales
                parts.append((entry.file, off, numel * entry.dtype.itemsize, entry.dtype, dest, numel, dtype))
            else:
                raise UserError(f"checkpoint tensor {key} in {index.folder} is {entry.dtype}; {layout.precision} stores "
                                f"its {suffix} as {dtype}: the file is not in the format its config.json says")
    for name, shape in zip(layout.names, layout.shapes):
        if len(shape) < 2:  # a vector (bias): the model's dtype
            dest = layout.part(name, -1, "")[0]
            for key, entry, off, numel in _locate(index, layer, path, prefix, e, E, name, shape):
                keys.add(key)
                parts.append((entry.file, off, numel * entry.dtype.itemsize, entry.dtype, dest, numel,
                              layout.compute_dtype))
                dest += numel * layout.compute_dtype.itemsize
    return _merged(parts)


_GGUF_EXPERTS = {("gate_up_proj", 0): "gate", ("gate_up_proj", 1): "up", ("down_proj", 0): "down"}


def _gguf_plan(index, layout: ShippedLayout, layer, path, e, keys) -> tuple[_Read, ...]:
    """Expert `e` of a GGUF file: its slice of `blk.N.ffn_{gate,up,down}_exps.weight` ([E, rows, row bytes],
    N the decoder layer of `path`) into each linear's place in the row, bytes as stored."""
    block = next(int(x) for x in path.split(".") if x.isdigit())
    parts = []
    for name, k, r, c, f in layout.matrices:
        key = f"blk.{block}.ffn_{_GGUF_EXPERTS[(name, k)]}_exps.weight"
        entry = index.tensors.get(key)
        (shape, _), = SHIPPED_CODECS[f].tensors(r, c).values()
        if entry is None or entry.shape[1:] != shape:
            raise UserError(f"{index.folder} has no {key} of [E, {shape[0]}, {shape[1]}] {f} blocks (layer {layer}, "
                            f"{path}); its metadata does not describe its tensors")
        nbytes = math.prod(shape)
        keys.add(key)
        parts.append((entry.file, entry.offset + e * nbytes, nbytes, torch.uint8, layout.part(name, k, "")[0], nbytes, None))
    return _merged(parts)


def _merged(parts: list[tuple]) -> tuple[_Read, ...]:
    """`parts` sorted by file position, adjacent ones joined into one read."""
    parts.sort(key=lambda p: (p[0], p[1]))
    reads, group = [], []
    for p in parts:
        if group and (p[0] != group[0][0] or p[1] != group[-1][1] + group[-1][2]):
            reads.append(_join(group))
            group = []
        group.append(p)
    reads.append(_join(group))
    return tuple(reads)


def _rows_plans(index, layout: QuantLayout | ShippedLayout, layer, path, E, keys) -> list[tuple[_Read, ...]]:
    """Expert e of a converted layer: row e of its [E, B] uint8 tensor, one read."""
    key = f"{path}.{ROWS_SUFFIX}"
    entry = index.tensors.get(key)
    if entry is None:
        raise UserError(f"the converted checkpoint in {index.folder} has no {key} (layer {layer}'s experts): it "
                        "was not converted from this model; convert it again")
    B = layout.numel
    if entry.dtype != torch.uint8 or entry.shape != (E, B):
        raise UserError(f"{key} in {index.folder} is {list(entry.shape)} {entry.dtype}, but {layout.precision} rows "
                        f"of this model are [{E}, {B}] uint8: it was converted at another dtype or from another "
                        "model; load it with the dtype it was converted at, or convert it again")
    keys.add(key)
    return [(_Read(entry.file, entry.offset + e * B, B, (_Piece(0, B, torch.uint8, 0, B),)),) for e in range(E)]


def _join(group: list[tuple]) -> _Read:
    file, start = group[0][0], group[0][1]
    pieces = tuple(_Piece(off - start, nb, dt, dest, n, into) for _, off, nb, dt, dest, n, into in group)
    end = group[-1][1] + group[-1][2]
    return _Read(file, start, end - start, pieces)


def _locate(index, layer, path, prefix, e, E, name, shape) -> list[tuple]:
    """[(key, entry, absolute offset, numel)] making up part `name` [shape] of expert e, in row order."""
    fused = f"{prefix}.{name}"
    entry = index.tensors.get(fused)
    numel = math.prod(shape)
    if entry is not None:  # stacked [E, *shape] as in memory: expert e is one slice
        _check_shape(index, fused, entry.shape, (E, *shape), layer, path, e, name)
        return [(fused, entry, entry.offset + e * numel * entry.dtype.itemsize, numel)]
    base, kind = (name[:-5], "bias") if name.endswith("_bias") else (name, "weight")
    groups = _PER_EXPERT.get(base, ((base,),))
    rows = shape[0] // len(groups) if shape else 0
    out, tried = [], [fused]
    for aliases in groups:
        cands = [f"{prefix}.{e}.{a}.{kind}" for a in aliases]
        key = next((k for k in cands if k in index.tensors), None)
        tried += cands
        if key is None:
            raise UserError(f"the checkpoint in {index.folder} has no {name} of layer {layer} expert {e} "
                            f"({path}): tried {', '.join(tried)}; it was not saved from this model, or this "
                            "architecture's experts are stored differently (seqmoe/disk/checkpoint.py)")
        want = (rows, *shape[1:])
        _check_shape(index, key, index.tensors[key].shape, want, layer, path, e, name)
        out.append((key, index.tensors[key], index.tensors[key].offset, math.prod(want)))
    return out


def _check_shape(index, key, got, want, layer, path, e, name) -> None:
    if tuple(got) != tuple(want):
        raise UserError(f"checkpoint tensor {key} in {index.folder} has shape {list(got)}, but {name} of layer "
                        f"{layer} expert {e} ({path}) needs {list(want)}: the checkpoint does not match the model's "
                        "config, or stores this architecture's experts differently")

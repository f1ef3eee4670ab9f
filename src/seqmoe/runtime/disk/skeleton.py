"""`load_skeleton`: a transformers MoE model with everything but its routed experts read from the checkpoint.

    model, skel = load_skeleton(folder)          # experts' parameters stay on the meta device
    model, experts_paths, layout = meta_model(folder)   # nothing read: shapes only
    files = skel.open_files()                    # ExpertFiles for the experts (checkpoint.py)

The model is built on the meta device (no memory), then each parameter and persistent buffer other
than the routed experts' is read from the checkpoint on its own (its exact key, else the family's
rename, e.g. Mixtral's `block_sparse_moe`), the non-persistent buffers (rotary `inv_freq`) are
recomputed by the model's own `_init_weights`, and tied embeddings are tied again. Peak memory is
the dense part: no expert byte is read here. A folder `seqmoe convert` wrote opens its experts as the
rows of its precision (`Skeleton.layout` a `QuantLayout`), a checkpoint shipped quantized (FP8 blocks,
MXFP4, GPTQ) as its own codes (a `ShippedLayout`); its quantized dense linears are decoded as they are
read, as transformers' own loader decodes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from seqmoe.arch import ExpertLayout, model_arch
from seqmoe.arch.quant import QuantLayout, store_layout, stored_precision
from seqmoe.arch.gguf_file import gguf_file, gguf_precision
from seqmoe.arch.shipped import GPTQ_GROUP, SHIPPED_CODECS, dense_fp8, shipped_precision
from seqmoe.arch.shipped_layout import ShippedLayout
from seqmoe.base.errors import UserError
from seqmoe.runtime.disk.checkpoint import ExpertFiles, checkpoint_keys
from seqmoe.runtime.disk.gguf import gguf_config, gguf_dense, gguf_index
from seqmoe.runtime.disk.index import CheckpointIndex
from seqmoe.runtime.disk.reader import DiskReader


@dataclass(frozen=True)
class Skeleton:
    """What `ExpertFiles.open` needs for a skeleton model, and what loading it read."""

    folder: Path
    experts_paths: tuple[str, ...]
    """Per MoE layer (the order of `model_arch(model).moe`), the module path of its routed experts."""
    layout: ExpertLayout | QuantLayout | ShippedLayout
    """The experts' rows as the files hold them."""
    num_experts: int
    index: CheckpointIndex
    dense_bytes: int
    """Bytes read from the checkpoint to build the model (the dense part; no expert byte)."""

    def open_files(self, mode: str | None = None) -> ExpertFiles:
        """The routed experts' tensors in the checkpoint (`mode`: the DiskReader's)."""
        return ExpertFiles.open(self.folder, self.experts_paths, self.layout, self.num_experts,
                                mode=mode, index=self.index)


def load_skeleton(folder, dtype: torch.dtype | str | None = None, *, mode: str | None = None, check=None):
    """(model, Skeleton): the `*ForCausalLM` of `folder` in eval mode, with its routed experts' parameters
    on the meta device and everything else read from the checkpoint. `dtype`: the model's (default: the
    config's, else float32). `check(model, arch, layout)`: runs on the meta model, before anything is
    read (budgets fail first). UserError for a quantization seqmoe does not read or model keys the checkpoint lacks."""
    folder = Path(folder)
    model, experts_paths, layout = meta_model(folder, dtype)
    if check is not None:
        check(model, model_arch(model), layout)
    skip = {f"{p}.{n}" for p in experts_paths for n in layout.names}
    gguf = gguf_file(folder)
    index = CheckpointIndex.open(folder) if gguf is None else gguf_index(gguf)
    nbytes = _materialise(model, index, skip, mode)
    _init_nonpersistent(model)
    if model.config.get_text_config().tie_word_embeddings:
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta and n not in skip]
    left += [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise UserError(f"the checkpoint in {folder} lacks {', '.join(left[:8])}{' ...' if len(left) > 8 else ''} "
                        f"({len(left)} model tensors); it was not saved from a {type(model).__name__}")
    stored = store_layout(layout, stored_precision(folder))
    return model.eval(), Skeleton(folder, experts_paths, stored, model_arch(model).num_experts, index, nbytes)


def meta_model(folder, dtype: torch.dtype | str | None = None):
    """(model, experts_paths, layout): the `*ForCausalLM` of `folder`'s config.json on the meta device (no
    memory), the module path of each MoE layer's routed experts, and their layout at the model's dtype
    (default: the config's, else float32). UserError for a checkpoint quantized by another tool."""
    from transformers import AutoConfig, AutoModelForCausalLM  # transformers: only when this runs

    folder = Path(folder)
    gguf = gguf_file(folder)
    if gguf is not None:
        gguf_precision(gguf)  # an architecture or block type seqmoe does not read fails here
        config = gguf_config(gguf)
    else:
        if not (folder / "config.json").is_file():
            raise UserError(f"{folder} has no config.json; give a folder saved by save_pretrained, or a GGUF file")
        shipped_precision(folder)  # a quantization seqmoe does not read fails here
        config = AutoConfig.from_pretrained(folder)
        config.quantization_config = None  # the experts stay in their codes (ShippedLayout), the dense part is decoded
    dtype = _resolve_dtype(dtype if dtype is not None else getattr(config, "dtype", None))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    arch = model_arch(model)
    names = {id(m): n for n, m in model.named_modules()}
    experts_paths = tuple(names[id(m.experts)] for m in arch.moe)
    return model, experts_paths, arch.layout(arch.moe[0].experts)  # shapes and dtype: works on meta parameters


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, dtype.removeprefix("torch."))
    if dtype in (None, "auto"):
        return torch.float32
    raise UserError(f"unknown dtype {dtype!r}; give e.g. float32 or bfloat16")


def _materialise(model: torch.nn.Module, index: CheckpointIndex, skip: set[str], mode: str | None) -> int:
    """Read every parameter and persistent buffer not in `skip` from the checkpoint, in place of the
    meta tensor; the bytes read. Tensors tied to one another appear once here (tie_weights re-ties)."""
    reader, files, nbytes, fp8 = DiskReader(mode), {}, 0, dense_fp8(index.folder)
    try:
        for name, meta, is_param in _dense_tensors(model, skip):
            if getattr(index, "gguf", None) is not None:  # a GGUF file: by its own tensor names, dequantized
                found = gguf_dense(index, name, reader, files)
                if found is not None:
                    value, read = found
                    if tuple(value.shape) != tuple(meta.shape):
                        raise UserError(f"{name} in {index.folder} is {list(value.shape)}, but the model's is "
                                        f"{list(meta.shape)}: the file's metadata does not describe its tensors")
                    _set(model, name, value.to(meta.dtype), is_param, meta)
                    nbytes += read
                continue
            found = _dense_keys(index, name, fp8)
            if found is None:
                continue  # tied (restored by tie_weights) or truly missing (reported after)
            precision, keys = found
            parts = {s: index.read_tensor(k, reader, files) for s, k in keys.items()}
            nbytes += sum(index.tensors[k].nbytes for k in keys.values())
            shape, value = tuple(meta.shape), parts.get("")
            if precision is not None and len(shape) == 2:  # a quantized linear, decoded as its format says
                want = {s: tuple(t) for s, (t, _) in SHIPPED_CODECS[precision].tensors(*shape).items()}
                if {s: tuple(t.shape) for s, t in parts.items()} == want:
                    value = SHIPPED_CODECS[precision].decode({s: t[None] for s, t in parts.items()}, *shape)[0]
            if value is None or tuple(value.shape) != shape:
                raise UserError(f"checkpoint tensor {next(iter(keys.values()))} in {index.folder} is shaped unlike "
                                f"the model's {name} ({list(shape)}): the checkpoint does not match its config.json")
            _set(model, name, value.to(meta.dtype), is_param, meta)
    finally:
        for f in files.values():
            reader.close(f)
    return nbytes


def _dense_keys(index: CheckpointIndex, name: str, fp8: str = "fp8-block"):
    """(shipped format or None, {part: checkpoint key}) of model tensor `name` in `index`: the tensor
    itself ({"": key}), an FP8 weight with its `weight_scale_inv` (in `fp8`'s blocks), or a GPTQ linear's
    four tensors (parts named as the format's codec names them); None when the checkpoint has none."""
    for key in checkpoint_keys(name):
        entry = index.tensors.get(key)
        if entry is not None:
            if entry.dtype == torch.float8_e4m3fn and key + "_scale_inv" in index.tensors:
                return fp8, {"weight": key, "weight_scale_inv": key + "_scale_inv"}
            return None, {"": key}
        base = key.removesuffix("weight")
        if key.endswith(".weight") and base + "qweight" in index.tensors:
            return "gptq-int4", {s: base + s for s in SHIPPED_CODECS["gptq-int4"].tensors(8, GPTQ_GROUP)}
    return None


def _dense_tensors(model: torch.nn.Module, skip: set[str]):
    """(name, meta tensor, is parameter) of each parameter and persistent buffer outside `skip`."""
    for name, p in model.named_parameters():
        if name not in skip:
            yield name, p, True
    for mod_name, module in model.named_modules():
        for leaf, b in module._buffers.items():
            if b is not None and leaf not in module._non_persistent_buffers_set:
                yield f"{mod_name}.{leaf}" if mod_name else leaf, b, False


def _set(model: torch.nn.Module, name: str, value: torch.Tensor, is_param: bool, meta: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(mod_name)
    if is_param:
        module.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=meta.requires_grad))
    else:
        module._buffers[leaf] = value


@torch.no_grad()
def _init_nonpersistent(model: torch.nn.Module) -> None:
    """Give each module's non-persistent buffers (not in checkpoints: rotary inv_freq, ...) the values the
    model's own `_init_weights` computes; UserError if it leaves a float buffer unset (NaN sentinel)."""
    for mod_name, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not any(module._buffers[n].is_meta for n in names):
            continue
        for n in names:
            b = module._buffers[n]
            module._buffers[n] = torch.full(b.shape, math.nan, dtype=b.dtype) if b.is_floating_point() \
                else torch.zeros(b.shape, dtype=b.dtype)
        model._init_weights(module)
        unset = [n for n in names if module._buffers[n].is_floating_point() and module._buffers[n].isnan().any()]
        if unset:
            raise UserError(f"{type(model).__name__}._init_weights does not compute the buffers {unset} of "
                            f"{mod_name} ({type(module).__name__}); seqmoe cannot load this model without its experts")

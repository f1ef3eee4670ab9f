"""Loading a checkpoint under the runtime: `seqmoe.load` (its routed experts streamed from disk), and
what `seqmoe generate` and `seqmoe serve` do before they decode (`load_offloaded`).

    model, runtime = seqmoe.load("path/to/checkpoint", residency=0.1, host_memory="8GiB")
    loaded = load_offloaded(LoadConfig(model="seqmoe-tiny"), OffloadConfig(residency=0.3), needs="...")
    loaded.model, loaded.tokenizer, loaded.runtime

A folder `seqmoe convert` wrote always loads through `load` (with all its experts in the host cache
unless `host_memory` says otherwise): its rows are already the store's.

`load` builds the model with its dense part read from the checkpoint and its routed experts never
in memory (`disk.skeleton.load_skeleton`); `offload` then runs it over a device pool of C slots and
a host cache of `host_memory` bytes of expert rows in front of the checkpoint's files (`disk.plan`,
`disk.host_cache`).

The training trace is read first (a bad file fails before the model loads); the seqmoe systems
given no forecaster learn theirs online (`seqmoe.brain.predict.online`), no training step first. The model is loaded on the CPU and then offloaded
(`offload`): its routed experts are packed into host memory and only the dense rest moves to the
device (cuda when available, unless the config names one), so the whole model never has to fit
there.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from seqmoe.arch import model_arch
from seqmoe.arch.collect import load_model
from seqmoe.arch.collect.models import load_tokenizer
from seqmoe.arch.model_dirs import has_tokenizer_files, resolve_model_dir
from seqmoe.arch.quant import stored_precision, store_layout
from seqmoe.base.errors import UserError
from seqmoe.brain.manager import capacity_for
from seqmoe.brain.manager.placement import capacity_for_bytes
from seqmoe.config import LoadConfig, OffloadConfig
from seqmoe.costs.precision import format_bytes, parse_bytes
from seqmoe.runtime.core.device import resolve_device
from seqmoe.runtime.disk.plan import plan_disk
from seqmoe.runtime.disk.skeleton import load_skeleton, meta_model
from seqmoe.runtime.offload import offload
from seqmoe.trace.io import load_trace


def load(path, residency: float | None = None, *, host_memory=None, dtype=None, config: OffloadConfig | None = None,
         **options):
    """(model, runtime): the `*ForCausalLM` in the checkpoint folder `path`, its routed experts
    streamed from disk through a host cache of `host_memory` bytes (default: room for all of them,
    or for what the free host memory holds when they do not fit).

    Args:
        residency, host_memory, **options: fields of `seqmoe.config.OffloadConfig` (e.g. system=,
            expert_memory=, miss=, device=); `config`: all of them at once.
        dtype: the dense part's and the host rows' dtype (default: the checkpoint config's).
    """
    given = {k: v for k, v in (("residency", residency), ("host_memory", host_memory)) if v is not None} | options
    cfg = dataclasses.replace(config, **given) if config is not None else OffloadConfig(**given)
    stored = stored_precision(path)  # converted by seqmoe, or shipped quantized: its experts stay as they are
    if stored is not None and cfg.expert_dtype not in (None, stored):
        raise UserError(f"{path} holds {stored} experts: they cannot be stored at {cfg.expert_dtype}; drop "
                        "expert_dtype (the experts stay in the file's codes)")
    cfg = dataclasses.replace(cfg, expert_dtype=stored or cfg.expert_dtype)

    model, skeleton = load_skeleton(path, dtype, check=lambda model, arch, layout: check_budgets(cfg, arch, layout, path))
    files = skeleton.open_files()
    try:
        runtime = offload(model, config=cfg, source=files)
    except BaseException:
        files.close()
        raise
    return model, runtime


def check_budgets(cfg: OffloadConfig, arch, layout, source=None) -> None:
    """UserError when `cfg`'s device budget (or host budget, streaming from `source`) cannot hold what a
    step needs, for the model `arch` whose experts have `layout`: run on the meta model, before any weight is read."""
    L, E, K = len(arch.moe), arch.num_experts, arch.top_k
    layout = store_layout(layout, cfg.expert_dtype)  # the store's rows
    if source is not None and cfg.host_memory is not None:  # without it, offload fits the cache to the free memory
        plan_disk(source, cfg, layout, L, E, K)
    if cfg.residency is not None:
        capacity_for(cfg.residency, L, E, K)
    elif cfg.expert_memory is not None:
        budget = parse_bytes(cfg.expert_memory, "expert_memory")
        capacity_for_bytes(budget, layout.expert_bytes, L, E, K, f"expert_memory {format_bytes(budget)}")


@dataclass(frozen=True)
class Loaded:
    model: object
    """The transformers model, offloaded."""
    tokenizer: object
    runtime: object
    """Its `OffloadRuntime`."""


def load_offloaded(load_cfg: LoadConfig, cfg: OffloadConfig, *, needs: str, progress: bool = False) -> Loaded:
    """Load `load_cfg.model` with its tokenizer and offload it as `cfg` says; `needs`: why a tokenizer is
    needed (said when the folder has none, before anything loads)."""
    if not has_tokenizer_files(resolve_model_dir(load_cfg.model)):
        raise UserError(f"{load_cfg.model} has no tokenizer files; {needs}")
    torch.set_num_threads(load_cfg.torch_threads())
    if isinstance(cfg.train, (str, os.PathLike)):  # a bad file fails before the model loads
        cfg = dataclasses.replace(cfg, train=load_trace(cfg.train))
    device = resolve_device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"), torch.device("cpu"))
    cfg = dataclasses.replace(cfg, device=str(device))
    folder = resolve_model_dir(load_cfg.model)
    dtype = None if load_cfg.dtype == "auto" else load_cfg.dtype
    if cfg.host_memory is not None or stored_precision(folder):  # experts read from disk, never as a full model
        model, runtime = load(folder, config=cfg, dtype=dtype)  # the budgets first, on the meta model
        tokenizer = load_tokenizer(folder)
        if tokenizer is None:
            runtime.close()
            raise UserError(f"{load_cfg.model}'s tokenizer files do not load; {needs}")
        return Loaded(model, tokenizer, runtime)
    meta, _, layout = meta_model(folder, dtype)  # the budgets before the weights load
    check_budgets(cfg, model_arch(meta), layout)
    model, tokenizer = load_model(load_cfg.model, device="cpu", dtype=load_cfg.dtype, progress=progress)
    if tokenizer is None:
        raise UserError(f"{load_cfg.model}'s tokenizer files do not load; {needs}")
    return Loaded(model, tokenizer, offload(model, config=cfg))

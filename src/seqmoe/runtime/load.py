"""A checkpoint loaded and offloaded: what `seqmoe generate` and `seqmoe serve` do before they decode.

    loaded = load_offloaded(LoadConfig(model="seqmoe-tiny"), OffloadConfig(residency=0.3), needs="...")
    loaded.model, loaded.tokenizer, loaded.runtime

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

from seqmoe.config import LoadConfig, OffloadConfig
from seqmoe.base.errors import UserError
from seqmoe.arch.model_dirs import has_tokenizer_files, resolve_model_dir


@dataclass(frozen=True)
class Loaded:
    model: object
    """The transformers model, offloaded."""
    tokenizer: object
    runtime: object
    """Its `OffloadRuntime`."""


def load_offloaded(load: LoadConfig, cfg: OffloadConfig, *, needs: str, progress: bool = False) -> Loaded:
    """Load `load.model` with its tokenizer and offload it as `cfg` says; `needs`: why a tokenizer is
    needed (said when the folder has none, before anything loads)."""
    if not has_tokenizer_files(resolve_model_dir(load.model)):
        raise UserError(f"{load.model} has no tokenizer files; {needs}")
    import torch

    from seqmoe.arch.collect import load_model
    from seqmoe.runtime.core.device import resolve_device
    from seqmoe.runtime.offload import offload
    from seqmoe.trace.io import load_trace

    if load.threads:
        torch.set_num_threads(load.threads)
    if isinstance(cfg.train, (str, os.PathLike)):  # a bad file fails before the model loads
        cfg = dataclasses.replace(cfg, train=load_trace(cfg.train))
    device = resolve_device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"), torch.device("cpu"))
    cfg = dataclasses.replace(cfg, device=str(device))
    if cfg.host_memory is not None:  # the experts stay on disk: build the model without them
        from seqmoe.arch.collect.models import load_tokenizer
        from seqmoe.runtime.disk.load import load as load_streamed

        tokenizer = load_tokenizer(resolve_model_dir(load.model))
        if tokenizer is None:
            raise UserError(f"{load.model}'s tokenizer files do not load; {needs}")
        model, runtime = load_streamed(resolve_model_dir(load.model), dtype=None if load.dtype == "auto" else load.dtype,
                                       config=cfg)
        return Loaded(model, tokenizer, runtime)
    model, tokenizer = load_model(load.model, device="cpu", dtype=load.dtype, progress=progress)
    if tokenizer is None:
        raise UserError(f"{load.model}'s tokenizer files do not load; {needs}")
    return Loaded(model, tokenizer, offload(model, config=cfg))

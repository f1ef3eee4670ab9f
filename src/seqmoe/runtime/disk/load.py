"""`seqmoe.load`: a checkpoint's MoE model run with its routed experts streamed from disk.

    model, runtime = seqmoe.load("path/to/checkpoint", residency=0.1, host_memory="8GiB")
    model.generate(input_ids, max_new_tokens=32)

The model is built with its dense part read from the checkpoint and its routed experts never in
memory (`skeleton.load_skeleton`); `offload` then runs it over a device pool of C slots and a host
cache of `host_memory` bytes of expert rows in front of the checkpoint's files (`plan`, `cache`).
"""

from __future__ import annotations

import dataclasses

from seqmoe.config import OffloadConfig
from seqmoe.costs.precision import format_bytes, parse_bytes


def load(path, residency: float | None = None, *, host_memory=None, dtype=None, config: OffloadConfig | None = None,
         **options):
    """(model, runtime): the `*ForCausalLM` in the checkpoint folder `path`, its routed experts
    streamed from disk through a host cache of `host_memory` bytes (default: room for all of them).

    Args:
        residency, host_memory, **options: fields of `seqmoe.config.OffloadConfig` (e.g. system=,
            expert_memory=, miss=, device=); `config`: all of them at once.
        dtype: the dense part's and the host rows' dtype (default: the checkpoint config's).
    """
    given = {k: v for k, v in (("residency", residency), ("host_memory", host_memory)) if v is not None} | options
    cfg = dataclasses.replace(config, **given) if config is not None else OffloadConfig(**given)
    from seqmoe.runtime.disk.skeleton import load_skeleton
    from seqmoe.runtime.offload import offload

    def check(model, arch, layout):  # both budgets, before the dense part is read
        from seqmoe.runtime.disk.plan import plan_disk
        from seqmoe.brain.manager import capacity_for
        from seqmoe.brain.manager.placement import capacity_for_bytes

        L, E, K = len(arch.moe), arch.num_experts, arch.top_k
        plan_disk(path, cfg, layout, L, E, K)
        if cfg.residency is not None:
            capacity_for(cfg.residency, L, E, K)
        elif cfg.expert_memory is not None:
            budget = parse_bytes(cfg.expert_memory, "expert_memory")
            capacity_for_bytes(budget, layout.expert_bytes, L, E, K, f"expert_memory {format_bytes(budget)}")

    model, skeleton = load_skeleton(path, dtype, check=check)
    files = skeleton.open_files()
    try:
        runtime = offload(model, config=cfg, source=files)
    except BaseException:
        files.close()
        raise
    return model, runtime


__all__ = ["load"]

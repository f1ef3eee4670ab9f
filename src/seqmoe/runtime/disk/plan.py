"""What `offload` decides and builds for a model whose routed experts stay in the checkpoint on disk.

    disk = plan_disk(files, cfg, expert_bytes, L, E, K)     # None without a source: experts in memory
    hosts = disk.open(system, layout, device, undo)          # per layer an [E, P]-like `DiskLayer`

The host cache's rows are checked against `cfg.host_memory` before anything is built; its tier's
policy follows the system (`tier.host_policy`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

from seqmoe.arch.quant import QuantLayout
from seqmoe.runtime.core.device import FIT_MARGIN, host_available
from seqmoe.runtime.disk.host_cache import HostCache
from seqmoe.brain.manager.disk_clock import DiskClock
from seqmoe.brain.manager.host_tier import HostTier, host_policy, host_rows_for
from seqmoe.brain.manager.miss_paths import MissPath
from seqmoe.base.errors import Note, UserError
from seqmoe.costs.precision import format_bytes, parse_bytes
from seqmoe.costs.profiles import disk_read_s


@dataclass
class DiskPlan:
    files: object
    """The checkpoint's expert tensors (`seqmoe.runtime.disk.checkpoint.ExpertFiles`)."""
    rows: int
    """H: rows of the host cache."""
    num_layers: int
    num_experts: int
    cache: HostCache | None = field(default=None, init=False)
    """Built by `open`."""

    def open(self, system, layout, device: torch.device, undo) -> list:
        """The host cache over the checkpoint (closed by `undo` if a later step fails); each MoE
        layer's host block as the runtime reads it."""
        L, E = self.num_layers, self.num_experts
        tier = HostTier(self.rows, L, E, policy=host_policy(system))
        store = None if layout == self.files.layout else layout  # a quantized store: rows quantized as read
        self.cache = HostCache(self.files, tier, layout.numel, layout.dtype, pin=device.type == "cuda", store=store)
        undo.push(self.cache.close)
        return [self.cache.layer(l) for l in range(L)]

    def clock(self, system, model, hardware, start, pool):
        """The simulator's disk tier on the runtime's virtual clock (`sim.DiskClock`, with a tier of
        its own: the virtual clock is the simulator's figure for these budgets, a disk read priced by
        `hardware` at the file's bytes of an expert, free when it describes no disk). The host cache's tier follows its decisions
        (evicting first what it let go), shares its forecast inputs and sees `pool`'s published
        slots. It reads nothing ahead: read-ahead is off in the tier (`tier.AHEAD_P`)."""
        on_disk = dataclasses.replace(model, expert_bytes=self.files.expert_nbytes(0, 0))  # a read's bytes: the file's
        read_s = disk_read_s(on_disk, hardware) if hardware.disk_bytes_per_s is not None else 0.0
        tier = HostTier(self.rows, self.num_layers, self.num_experts, policy=host_policy(system), read_s=read_s,
                        start=start)
        # The simulated tier decides; the real one follows where its rows' use allows. Rows of experts
        # whose copy is done go first: one with a copy still queued is needed again.
        self.cache.tier.watch(resident=lambda: (pool.table_host >= 0).reshape(-1), leader=tier)
        return DiskClock(tier, model=model, hardware=hardware)

    def first_expert(self, layer: int) -> dict[str, torch.Tensor]:
        """Expert 0 of MoE layer `layer`, read from disk: {parameter name: its slice}."""
        layout = self.files.layout
        row = torch.empty(layout.numel, dtype=layout.dtype)
        self.files.read_into(layer, 0, row)
        return {name: v[0] for name, v in layout.views(row[None]).items()}

    def observer(self, inner):
        """The manager's observer: the host cache hears which rows the ordered transfers need (their
        reads start at the decision, before the copy is queued), then `inner` (the controller)."""
        return _CacheObserver(inner, self.cache)


def plan_disk(source, cfg, layout, num_layers: int, num_experts: int, top_k: int, others: int = 0) -> DiskPlan | None:
    """The disk tier `cfg` asks for over `source` (None: no source, experts in memory), its rows of
    `layout` (the store's): host_memory's, else every expert when they fit in the free host memory
    beside `others` bytes (the rest of the model, a pool in host memory), else what fits there (said
    in a warning); UserError when host_memory is given without a source or holds too few experts."""
    if source is None:
        if cfg.host_memory is not None:
            raise UserError("host_memory streams the routed experts from a checkpoint on disk: load the model "
                            "with seqmoe.load(path, host_memory=...) (seqmoe generate --model PATH --host-memory ...)")
        return None
    n = num_layers * num_experts
    twins = 0 if cfg.twin is None else n * QuantLayout.of(getattr(layout, "base", layout), cfg.twin).expert_bytes
    if cfg.host_memory is not None:  # low-bit twins live in the same host memory
        budget = parse_bytes(cfg.host_memory, "host_memory")
        return DiskPlan(source, host_rows_for(budget, layout.expert_bytes, num_layers, num_experts, top_k,
                                              f"host_memory {format_bytes(budget)}", twins), num_layers, num_experts)
    room = int(host_available() * (1 - FIT_MARGIN)) - others
    if n * layout.expert_bytes + twins <= room:
        return DiskPlan(source, n, num_layers, num_experts)
    rows = host_rows_for(room, layout.expert_bytes, num_layers, num_experts, top_k,
                         f"the free host memory ({format_bytes(max(room, 0))} beside the rest of the model)", twins)
    warnings.warn(Note(f"the routed experts take {format_bytes(n * layout.expert_bytes)} and the free host memory holds "
                  f"{format_bytes(rows * layout.expert_bytes)} of them: a host cache of {rows} of {n} experts, the "
                  "rest read from disk as they are needed (give host_memory / --host-memory to choose)"), stacklevel=2)
    return DiskPlan(source, rows, num_layers, num_experts)


class _CacheObserver:
    """Forwards the manager's events to the controller and starts the host cache's reads."""

    def __init__(self, inner, cache: HostCache) -> None:
        self.inner, self.cache = inner, cache

    def on_load(self, uid: int, demand: bool, deadline_step: int) -> None:
        self.cache.prefetch(uid, copy=True)
        self.inner.on_load(uid, demand, deadline_step)

    def on_promote(self, uid: int) -> None:
        self.inner.on_promote(uid)

    def on_evict(self, uid: int) -> None:
        self.inner.on_evict(uid)

    def on_off_pool(self, uid: int, path: MissPath) -> None:
        if not path.twin:  # computed on the host CPU or read in place: its host row must be read first
            self.cache.prefetch(uid)
        self.inner.on_off_pool(uid, path)

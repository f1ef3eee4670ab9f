"""The low-bit twins of every layer's experts in host memory (the twin miss path,
`seqmoe.brain.manager.miss_paths.Twin`).

    store = TwinStore.of("int4", base_layout, device, originals=originals)   # or files=: read from a checkpoint
    rows = store.rows(layer, [3, 5])          # [2, B] on the device, read over the link

Each expert is packed a second time at the twin's precision, from the model's own weights (not
from the store's quantized ones, so an int4 twin under an int8 store is as good as an int4 store).
With a disk tier each expert is read once from the checkpoint to pack its twin (`read`). The
memory manager marks the misses its twins serve; the eager experts call computes those from their
twin rows (`eager.experts`), a posted step from the same rows read in place on the device
(`gather_posted_params`), and every other routed expert as usual, and adds the two.
"""

from __future__ import annotations

import math
import time

import torch

from seqmoe.arch.quant import QuantLayout


class TwinStore:
    """Twin rows [E, B] of each layer in host memory (pinned for a CUDA pool).

    Args:
        hosts: one [E, B] block per MoE layer, packed by `layout`.
        layout: the twins' `QuantLayout`.
        device: where `rows` puts the rows read.
        link_s: CPU only: seconds each twin row costs on the emulated link (None: none).
    """

    def __init__(self, hosts: list[torch.Tensor], layout, device: torch.device, link_s: float | None = None) -> None:
        self.hosts, self.layout, self.device, self.link_s = hosts, layout, device, link_s
        self.reads = 0
        """Twin rows read so far by the host (eager calls); `posted_reads`: by posted steps, on the device."""
        self.device_reads = torch.zeros(2, dtype=torch.int64, device=device)  # (slot, host) reads of posted steps
        self._mapped: list[torch.Tensor] | None = None  # the twin rows as the device sees them (first posted read)
        self._no_slots: torch.Tensor | None = None
        self._bufs: dict[int, tuple] = {}  # per number of positions: a posted read's buffers

    @classmethod
    def of(cls, precision: str, base_layout, device: torch.device, *, originals=None, files=None,
           link_s: float | None = None) -> TwinStore:
        """The twins at `precision` of every expert: packed from `originals` (their weights in memory),
        or with `files` (a checkpoint streamed from disk) each expert read once from it."""
        layout = QuantLayout.of(base_layout, precision)
        return cls.pack(originals, layout, device, link_s) if files is None else cls.read(files, layout, device, link_s)

    @classmethod
    def pack(cls, originals, layout, device: torch.device, link_s: float | None = None) -> TwinStore:
        """The twins of every layer's experts (`originals`, their parameters still in place)."""
        hosts = []
        for x in originals:
            host = torch.empty((int(x.num_experts), layout.numel), dtype=layout.dtype, pin_memory=device.type == "cuda")
            layout.pack(x, host)
            hosts.append(host)
        return cls(hosts, layout, device, link_s)

    @classmethod
    def read(cls, files, layout, device: torch.device, link_s: float | None = None) -> TwinStore:
        """The twins of every expert of a checkpoint streamed from disk (`files`: its `ExpertFiles`),
        each expert read once: from its weights as stored (a converted checkpoint's dequantized)."""
        src = files.layout
        row = torch.empty(src.numel, dtype=src.dtype)
        hosts = []
        for layer in range(files.num_layers):
            host = torch.empty((files.num_experts, layout.numel), dtype=layout.dtype, pin_memory=device.type == "cuda")
            for e in range(host.shape[0]):
                files.read_into(layer, e, row)
                layout.pack_views(src.views(row[None]), host[e:e + 1])
            hosts.append(host)
        return cls(hosts, layout, device, link_s)

    @property
    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.hosts)

    def gather_posted_params(self, layer: int, ids: torch.Tensor, take: torch.Tensor) -> dict[str, torch.Tensor]:
        """The twins' parameters at the routed positions `ids` [n] (device) where `take` [n] bool, zeros
        elsewhere: read from the mapped twin rows on the device, no host value read (a posted step).
        Reads are counted on the device (`device_reads`)."""
        from seqmoe.runtime.core.mapped import dequantizes, device_view, gather_dequantized, gather_rows

        n, dev = ids.shape[0], self.device
        if self._mapped is None:
            self._mapped = [device_view(h, dev) for h in self.hosts]
            self._no_slots = torch.full((self.hosts[0].shape[0],), -1, dtype=torch.int32, device=dev)
        if n not in self._bufs:
            out = torch.empty((n, self.layout.numel), dtype=self.layout.dtype, device=dev)
            deq = {p.name: torch.empty((n, math.prod(p.shape)), dtype=self.layout.compute_dtype, device=dev)
                   for p in self.layout.parts}
            self._bufs[n] = (out, deq, torch.empty((n,), dtype=torch.int32, device=dev))
        out, deq, slots = self._bufs[n]
        skip = ~take
        if dequantizes(self.layout, dev):
            return gather_dequantized(out, self._mapped[layer], self._no_slots, ids, self.layout, deq,
                                      self.device_reads, slots, skip)
        rows = gather_rows(out, self._mapped[layer], self._no_slots, ids, out, self.device_reads, slots, skip)
        if self.link_s:  # a CPU run's emulated link: each twin read costs its time
            time.sleep(int(take.sum()) * self.link_s)
        return self.layout.views(rows)

    @property
    def posted_reads(self) -> int:
        """Twin rows posted steps read on the device."""
        return int(self.device_reads[1])

    def rows(self, layer: int, ids: list[int]) -> torch.Tensor:
        """[n, B] twin rows of experts `ids` of `layer`, on the device."""
        host = self.hosts[layer]
        rows = torch.stack([host[e] for e in ids]).to(self.device, non_blocking=True)
        self.reads += len(ids)
        if self.link_s:
            time.sleep(len(ids) * self.link_s)
        return rows

"""The low-bit twins of every layer's experts in host memory (the twin miss path,
`seqmoe.brain.manager.miss_paths.Twin`).

    store = TwinStore.pack(originals, QuantLayout.of(base_layout, "int4"), device, undo)
    store = TwinStore.read(files, QuantLayout.of(base_layout, "int4"), device)   # experts streamed from disk
    rows = store.rows(layer, [3, 5])          # [2, B] on the device, read over the link

Each expert is packed a second time at the twin's precision, from the model's own weights (not
from the store's quantized ones, so an int4 twin under an int8 store is as good as an int4 store).
The memory manager marks the misses its twins serve; the eager experts call computes those from
their twin rows (`eager.experts`) and every other routed expert as usual, and adds the two.
"""

from __future__ import annotations

import time

import torch


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
        """Twin rows read so far."""

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

    def rows(self, layer: int, ids: list[int]) -> torch.Tensor:
        """[n, B] twin rows of experts `ids` of `layer`, on the device."""
        host = self.hosts[layer]
        rows = torch.stack([host[e] for e in ids]).to(self.device, non_blocking=True)
        self.reads += len(ids)
        if self.link_s:
            time.sleep(len(ids) * self.link_s)
        return rows

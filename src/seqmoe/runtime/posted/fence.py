"""When a slot released in thread mode may be overwritten: table versions the device acknowledged,
and forwards the device has completed. Why that is safe: docs/decode.md, "The slot fence".

    fence = ReadFence(device)
    fence.publish(version)          # pool: after each slot-table store, the table's new version
    token = fence.released(version) # pool.release: what a refill of the slot waits for
    fence.ready(token)              # copy worker: every read that may have seen the old entry is done
    seq = fence.begin(); ...; fence.end(seq)   # model thread: one forward's device work (see `Controller`)

`version` is pinned host memory the device reads, `acked` pinned host memory the device writes
(both through their mapped views, `mapped.device_view`); `snap` is device memory. Each mailbox post
(`Mailbox.post`, one per posted layer, before that layer's experts read the table) acknowledges
`snap` (the version the previous layer's reads started from) and takes a new snapshot of `version`.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from seqmoe.runtime.core.mapped import device_view


class ReadFence:
    """The table-version handshake with the device and the ledger of forwards.

    Args:
        device: where the model runs (on CUDA the two host words are pinned and mapped).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self._version = torch.zeros((1,), dtype=torch.int64, pin_memory=pin)  # written by the host only
        self._acked = torch.zeros((1,), dtype=torch.int64, pin_memory=pin)  # written by the device only
        self.version_np, self.acked_np = self._version.numpy(), self._acked.numpy()
        self.version_dev = device_view(self._version, device)
        self.acked_dev = device_view(self._acked, device)
        self.snap = torch.zeros((1,), dtype=torch.int64, device=device)  # version the current layer's reads started from
        self._lock = threading.Lock()
        self.begun = 0  # forwards begun (model thread)
        self._ended: deque[tuple[int, object]] = deque()  # (seq, CUDA event or None) not yet seen complete
        self._completed = 0  # every forward up to this one has completed on the device

    # -- the table version (pool, under its lock) --------------------------------------------------
    def publish(self, version: int) -> None:
        """The slot table changed: its new `version` (the table store came first)."""
        self.version_np[0] = version

    def acked(self) -> int:
        """The largest version the device acknowledged (as the host sees it now; it may lag)."""
        return int(self.acked_np[0])

    def ack(self) -> None:
        """Device ops of one post (CPU, or CUDA without triton): acknowledge the previous layer's
        snapshot, then take this layer's. The Triton post kernel does the same (`kernels.mapped`)."""
        self.acked_dev.copy_(self.snap)
        self.snap.copy_(self.version_dev)

    def released(self, version: int) -> tuple[int, int]:
        """A slot's table entry was cleared at `version`: (version, forwards begun) a refill waits for."""
        with self._lock:  # a full memory fence: the clear is visible before `begun` is read
            return version, self.begun

    def ready(self, token: tuple[int, int]) -> bool:
        """True once the device acknowledged the clearing version or completed every forward begun by then."""
        version, begun = token
        return self.acked() >= version or self.completed() >= begun

    # -- the ledger of forwards (model thread) ---------------------------------------------------------
    def begin(self) -> int:
        """A forward that may read the pool starts (before any of its device work is queued); its number."""
        with self._lock:
            self.begun += 1
            return self.begun

    def end(self, seq: int) -> None:
        """Forward `seq` queued all its device work (or was cut short): complete once that work is."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._ended.append((seq, event))
            self._pop_completed()  # keeps the queue (and its events) short when no refill asks

    def completed(self) -> int:
        """The number of the last forward such that it and every earlier one completed on the device."""
        with self._lock:
            self._pop_completed()
            return self._completed

    def _pop_completed(self) -> None:
        while self._ended and (self._ended[0][1] is None or self._ended[0][1].query()):
            self._completed = self._ended.popleft()[0]

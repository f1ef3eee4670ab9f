"""The step's side of the host relay (`posted.host_relay`) as device kernels, so a CUDA decode step with
the host path reads no host value and stays capturable as a graph.

    side = RelayKernels(relay, device)              # needs triton (on the CPU: TRITON_INTERPRET=1)
    side.post(layer, x, index, weights)             # the call's inputs to the mapped rings, then the flag
    weights, flags, rows = side.keep(layer, index, weights)  # waits for the decision; host positions get weight 0
    out = side.add(layer, out)                      # waits for the host's sum and adds it, in place

Each kernel finds its ring slot from the mailbox's device count of posts (the layer's router has
posted: step = (posts - 1) // L), as the mailbox's post kernel does. The device writes data, a
barrier, then the flag with a system-scope release store (the mailbox's order). The host writes
data, a full fence, then the flag; the device polls the flag with system-scope acquire loads, so
what it reads after seeing the flag is at least what the host wrote before it. No word is both
written by the host and read-modify-written by the device (PCIe gives no atomics against the CPU).

Every wait ends: once the host raises `abort` (the control thread stopped, a host job failed, the
runtime closed) or after a bound of polls (a partner that never answers is a bug, not a wait). A
decision that does not come costs nothing in exactness: the step then computes every routed expert
itself, reading the missing rows in place (`fallbacks` counts it). An output that does not come
cannot be made up: the step's output becomes NaN, `failures` counts it and `HostRelay.check`
raises it on the host.
"""

from __future__ import annotations

import functools

import torch

from seqmoe.runtime.core.mapped import device_view
from seqmoe.runtime.kernels import relay_triton

KEEP_SPINS = 1 << 22
"""Polls of the decision flag before the step computes the layer itself (seconds over PCIe)."""
OUT_SPINS = 1 << 25
"""Polls of the host's output flag before the step gives up on it (tens of seconds over PCIe)."""
FALLBACKS, FAILURES, ABORT = range(3)
"""Words of the mapped status: written by the device (the counts) or the host (abort)."""
_BH = 1024


class RelayKernels:
    """The three kernels of one runtime's relay, bound to its rings (`host_relay.HostRelay`)."""

    def __init__(self, relay, device: torch.device, keep_spins: int = KEEP_SPINS, out_spins: int = OUT_SPINS) -> None:
        self.relay, self.device = relay, device
        self.k = _build()
        self.keep_spins, self.out_spins = keep_spins, out_spins
        self.BK = max(2, 1 << (relay.rows * relay.K - 1).bit_length())  # one build for every batch size
        v = lambda t: device_view(t, device)  # noqa: E731
        self.x, self.index, self.weights, self.out, self.on_host = map(v, (relay.x, relay.index, relay.weights,
                                                                           relay.out, relay.on_host))
        self.xseq, self.dseq, self.oseq = v(relay.seqs)
        self.status = v(relay.status)
        self.skip = torch.zeros((relay.rows * relay.K,), dtype=torch.int8, device=device)
        self.hrow = v(relay.hrow) if relay.hrow is not None else self.skip  # (a placeholder without a disk tier)
        self.hids = torch.zeros((relay.rows * relay.K,), dtype=torch.int64, device=device)
        self.fell = torch.zeros((1,), dtype=torch.int32, device=device)
        self._kept: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def post(self, layer: int, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        r = self.relay
        flat = [t.reshape(-1).contiguous() for t in (x, index, weights)]  # the kernels index flat memory
        self.k["post"][(1,)](*flat, r.box.posts, self.x, self.index, self.weights, self.xseq, layer, r.L, r.R,
                             flat[0].numel(), flat[1].numel(), self.x.shape[1], self.index.shape[1], BH=_BH, BK=self.BK)

    def keep(self, layer: int, index: torch.Tensor,
             weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(weights with the host's and the twins' positions at 0, [B x K] int8 flags: 1 where the host
        computes, 2 where a twin serves, 0 elsewhere, [B x K] host-cache rows with a disk tier or None)."""
        r, n = self.relay, index.numel()
        kept = self._kept.get((weights.dtype, n))
        if kept is None:
            kept = self._kept[weights.dtype, n] = torch.empty((n,), dtype=weights.dtype, device=self.device)
        self.k["keep"][(1,)](index.reshape(-1).contiguous(), weights.reshape(-1).contiguous(), r.box.posts,
                             self.on_host, self.dseq, self.status, kept, self.skip, self.fell, self.hrow, self.hids,
                             layer, r.L, r.R, self.on_host.shape[1], n, self.keep_spins, BK=self.BK,
                             HAS_ROWS=r.hrow is not None)
        rows = self.hids[:n] if r.hrow is not None else None
        return kept.view(weights.shape), self.skip[:n], rows

    def add(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """`out` [B, H] plus the host's sum (in place), unless the step fell back to computing all."""
        r, out = self.relay, out.contiguous()
        self.k["add"][(1,)](out, self.out, r.box.posts, self.oseq, self.status, self.fell, layer, r.L, r.R,
                            out.numel(), self.out.shape[1], self.out_spins, BH=_BH)
        return out

    def warm(self) -> None:
        """Compile and load the kernels before any capture (a first launch inside one would compile
        there): launches against ring slot 0, whose flags are then reset (no step has run yet, so
        no host job can see them)."""
        r = self.relay
        posts = r.box.posts
        saved = posts.clone()
        posts.fill_(1)  # step 0, slot of layer 0
        x = torch.zeros((1, r.H), dtype=r.x.dtype, device=self.device)
        index = torch.zeros((1, r.K), dtype=torch.int64, device=self.device)
        r.dseq[0] = 0
        for dtype in {torch.float32, r.x.dtype}:  # routers give weights in one or the other
            w = torch.zeros((1, r.K), dtype=dtype, device=self.device)
            self.post(0, x, index, w)
            self.keep(0, index, w)
        self.fell.fill_(1)  # add returns at once
        self.add(0, x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        posts.copy_(saved)
        self.fell.zero_()
        r.xseq[0] = r.dseq[0] = -1
        r.status_np[:] = 0


def available() -> bool:
    """Whether the relay's kernels can be built: triton is installed, with `tl.atomic_load`."""
    try:
        import triton.language as tl  # triton: only when this runs
    except ImportError:
        return False
    return hasattr(tl, "atomic_load")


@functools.cache
def _build() -> dict:
    return {"post": relay_triton.post, "keep": relay_triton.keep, "add": relay_triton.add}

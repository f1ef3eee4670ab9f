"""The routing mailbox: how a decode step's routing reaches the host without the step waiting for it.

    box = Mailbox(num_layers, top_k, device, fence)
    box.post(layer, ids, weights, tokens)     # model thread, inside the decode step: device ops only
    ids, weights, tokens = box.wait(step, layer, rows)   # control thread: spins until (step, layer) is posted
    box.skip_to(step)                         # model thread: after a step cut short, post as `step`

The mailbox is pinned host memory that the device writes through its mapped view (`core.mapped`): a
ring of R decode steps x L layers of routed ids and gate weights (up to `MAX_ROWS` rows of a batched
step; how many a step has is known on the host when it is launched), the step's input tokens, and per
(step, layer) the step number once its routing is complete, written after the routing (stream
order, so the host sees the routing before the number). Each post also acknowledges the slot
table's version for the slot fence (`fence.ReadFence`, argued in docs/decode.md). Each post is a handful
of small device ops (one Triton kernel on CUDA) whose indices are
device tensors: nothing in it depends on a host value, so it records into a CUDA graph and replays
with the step counter it keeps on the device. The model thread keeps at most R / 2 steps ahead of
the control thread (`ControlThread.launch`), so a slot of the ring is never overwritten before it
is read; a reader that finds its step overwritten raises.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from seqmoe.base.errors import UserError
from seqmoe.runtime.posted.fence import ReadFence
from seqmoe.runtime.core.mapped import device_view, post_kernel

RING = 64
"""Decode steps the mailbox holds."""
MAX_ROWS = 16
"""Rows (sequences) a posted decode step holds at most: the mailbox's width."""


class Mailbox:
    """Routing of decode steps, posted by the device, read by the control thread.

    Args:
        num_layers, top_k: L, K.
        device: where the model runs (posts are ops on this device).
        fence: the slot fence each post acknowledges (None: posts acknowledge nothing).
        ring: R, steps held.
        rows: rows a step holds at most.
    """

    def __init__(self, num_layers: int, top_k: int, device: torch.device, fence: ReadFence | None = None,
                 ring: int = RING, rows: int = MAX_ROWS) -> None:
        self.L, self.K, self.R, self.rows, self.device, self.fence = num_layers, top_k, ring, rows, device, fence
        pin = device.type == "cuda"
        self._ids = torch.full((ring * num_layers, rows * top_k), -1, dtype=torch.int32, pin_memory=pin)
        self._weights = torch.zeros((ring * num_layers, rows * top_k), dtype=torch.float32, pin_memory=pin)
        self._tokens = torch.full((ring, rows), -1, dtype=torch.int64, pin_memory=pin)
        self._seq = torch.full((ring * num_layers,), -1, dtype=torch.int64, pin_memory=pin)
        self.ids_np, self.weights_np = self._ids.numpy(), self._weights.numpy()
        self.tokens_np, self.seq_np = self._tokens.numpy(), self._seq.numpy()
        v = lambda t: device_view(t, device)  # noqa: E731
        self._d_ids, self._d_weights, self._d_tokens, self._d_seq = v(self._ids), v(self._weights), v(self._tokens), v(self._seq)
        self.posts = torch.zeros((1,), dtype=torch.int64, device=device)  # layers posted, on the device
        self.muted = False  # graph warm-up: run the step without posting
        self.kernel = post_kernel(device)
        if self.kernel is not None:
            self.warm()

    def warm(self, rows: int = 1) -> None:
        """Compile and load the post kernel for steps of `rows` rows before any capture (DecodeGraph's
        warm-up steps post nothing, and a first launch inside a capture would compile there): one
        post with and one without tokens, then the ring, the count and the fence as they were. Run
        only while no step is being read (at construction, or once the control thread caught up)."""
        f = self.fence
        state = [self.posts] + ([f.snap] if f is not None else [])
        saved, acked = [t.clone() for t in state], f.acked_np.copy() if f is not None else None
        ids = torch.zeros((rows, self.K), dtype=torch.int64, device=self.device)
        self.post(0, ids, ids.float(), ids[:, 0])
        self.post(1 % self.L, ids, ids.float(), None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for t, s in zip(state, saved):
            t.copy_(s)
        if f is not None:
            f.acked_np[:] = acked
        self.seq_np[:] = -1

    def skip_to(self, step: int) -> None:
        """Number the next post layer 0 of `step` (after a step cut short; a device op, stream-ordered)."""
        self.posts.fill_(step * self.L)

    def post(self, layer: int, ids: torch.Tensor, weights: torch.Tensor, token: torch.Tensor | None) -> None:
        """Post one decode step's routing at `layer` ([B, K] ids and weights of its B rows; their
        input tokens [B] at layer 0).

        Device ops only (no host value is read): safe inside a captured decode step."""
        if self.muted:
            return
        # flat memory, one dtype each: one compiled kernel whatever the router gives
        ids, weights = ids.reshape(-1).long().contiguous(), weights.reshape(-1).float().contiguous()
        n, rows = ids.shape[0], ids.shape[0] // self.K
        if rows > self.rows:
            raise UserError(f"a posted decode step holds {self.rows} rows at most, got {rows}; decode fewer sequences "
                            "at once or use control='inline'")
        kernel, f = self.kernel, self.fence
        if kernel is not None:  # one Triton kernel (CUDA)
            fence = (f.snap, f.version_dev, f.acked_dev) if f is not None else (self.posts,) * 3
            kernel[(1,)](ids, weights, token.reshape(-1).contiguous() if token is not None else ids, self.posts, self._d_ids,
                         self._d_weights, self._d_tokens, self._d_seq, *fence, layer, self.L, self.R, n, self.rows * self.K,
                         rows, self.rows, HAS_TOKEN=token is not None, HAS_FENCE=f is not None,
                         BK=max(2, 1 << (n - 1).bit_length()), BT=max(2, 1 << (rows - 1).bit_length()))
            return
        step = torch.div(self.posts, self.L, rounding_mode="floor")
        ring = torch.remainder(step, self.R)
        at = ring * self.L + layer
        self._d_ids[:, :n].index_copy_(0, at, ids.view(1, n).to(torch.int32))
        self._d_weights[:, :n].index_copy_(0, at, weights.view(1, n).to(torch.float32))
        if token is not None:
            self._d_tokens[:, :rows].index_copy_(0, ring, token.reshape(1, rows).to(torch.int64))
        self._d_seq.index_copy_(0, at, step)  # a later op: the host reads the routing as complete
        self.posts.add_(1)
        if f is not None:
            f.ack()

    def wait(self, step: int, layer: int, give_up=lambda: False,
             rows: int = 1) -> tuple[np.ndarray, np.ndarray, list[int] | None] | None:
        """Spin until `step`'s routing at `layer` is posted; (ids [rows, K], weights [rows, K], the
        rows' input tokens at layer 0 else None), or None once `give_up()` is true while waiting.
        RuntimeError if it was overwritten (the reader fell a ring behind)."""
        at = (step % self.R) * self.L + layer
        spins = 0
        while (seen := int(self.seq_np[at])) != step:
            if seen > step:
                break
            spins += 1
            if spins > 200:
                time.sleep(20e-6)
                if give_up():
                    return None
        n = rows * self.K
        ids, weights = self.ids_np[at, :n].reshape(rows, self.K).copy(), self.weights_np[at, :n].reshape(rows, self.K).copy()
        token = self.tokens_np[step % self.R, :rows].tolist() if layer == 0 else None
        if int(self.seq_np[at]) != step:
            raise RuntimeError(f"decode step {step} layer {layer} was overwritten before the control plane read it "
                               f"(it fell {self.R} steps behind)")
        return ids, weights, token

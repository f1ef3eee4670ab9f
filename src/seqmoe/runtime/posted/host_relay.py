"""The host CPU path of a posted decode step (`control="thread"`): the routed experts the memory
manager sends to the host CPU are computed there while the step computes the others, and the step
reads no host value to learn which or to get their output.

    # the step (model thread), in a posting forward's experts call of `layer`:
    weights, skip, rows, twins = relay.enter(layer, x, index, weights)  # post, wait for the decision:
    out = relay.leave(layer, device_part(x, index, weights))  # the host's positions at weight 0; add its sum
    # the control thread, after the state machine's reveal of (step, layer):
    relay.decide(step, layer, host_ids)

Three rings of (mapped) host memory, `RING` steps x L layers, each slot wide enough for the
mailbox's most rows (a batched step posts its B rows; the control thread learns B from the
mailbox) and holding the number of the step it holds, written after its data (stream order on a
device, program order on the host), so a reader that sees the step's number sees its data: the
experts call's inputs (hidden states, routed ids and weights, posted by the step before it waits
for anything: the host computes from exactly what the call got), the decision (which of the
layer's E experts the host computes, for every row: each such expert runs once on the rows routed
to it), and the host's summed output (zeros, flagged with the decision, when the host computes
none). A few steps suffice:
a step waits in every layer for the control thread's decision, so the model thread is never more
than one step ahead of the relay's reader, and the one host worker runs jobs in order. The host's
positions get weight 0 in the step's own experts call, and the gather reads zeros for them instead
of their rows (an exact 0 is added, and no row crosses the link). The decision also carries the
experts the twin miss path gives to their low-bit twins (flag 2), which the step computes from
their twin rows (`posted.experts`).

The host worker (`HostExecutor`'s one thread) waits for the hidden state of each job; a job whose
step ended without posting it (an error or Ctrl-C mid-step) gives up once the model thread closes
that step (`close_step`) or the control thread stops (the runtime closing). The step's own waits
give up with an error when the control thread or a host job has failed: no wait outlives its partner.

With a disk tier (`disk`: the host cache and the slot table) the relay runs in every posted step,
host CPU path or not: a routed expert that holds no slot is read in place from a row of the host
cache, which may still be on disk. At its decision the control thread holds (`HostCache.pin`) the
row of each routed expert of the layer that holds no published slot and is not computed on the
host, waiting for its read, and writes the row numbers beside the decision (`hrow`); the step reads
them as it reads the decision, so it waits for the disk on the device side, never reading a host
value. A published slot is released only at a later reveal, which needs a later post, and a later
post follows this layer's gather in stream order: so a position the decision left without a row
finds its slot at gather time, and the holds are released at the next decision (or when the step
is cut short, after the stream has synchronised).

On the CPU backend the step's waits spin on numpy views of the rings. On CUDA the rings are pinned
and mapped and the step's side is three device kernels (`kernels.relay`), so the step reads no host
value and is captured in the decode graph; their waits end on `abort` (raised here when the
control thread stops, a host job fails or the runtime closes) and `check` raises what they could
not make exact.
Where it sits in a decode step: docs/decode.md, "On CUDA: posted and captured".
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from seqmoe.base.errors import UserError
from seqmoe.runtime.kernels.relay import ABORT, FAILURES, FALLBACKS, RelayKernels

SPINS = 200
"""Tight polls before each wait starts sleeping between polls."""
NAP_S = 20e-6
RING = 4
"""Decode steps the rings hold."""
STEP_WAIT_S = 60.0
"""The longest a step waits for a decision or an output before it raises (a stalled partner is a bug)."""


class HostRelay:
    """The rings and both sides of the protocol above, for one runtime.

    Args:
        mailbox: the routing mailbox (its ring size, L, K, and the device's count of layers posted).
        hidden_size, dtype: of the hidden states and outputs.
        executor: the `HostExecutor` whose thread computes host experts.
        clones: one `HostExecutor.clone` of each layer's experts module.
        layout, hosts: the packed expert layout and each layer's [E, P] host block.
        control_failed: true once the control thread has stopped or failed (the step's waits give up).
        device: where the step runs (on CUDA the rings are pinned and the step's side is `kernels.relay`).
        disk: (the host cache, the pool's host slot table) with a disk tier, else None.
        twins: the twin miss path is on (a decision may give experts to their twins).
    """

    def __init__(self, mailbox, hidden_size: int, dtype: torch.dtype, executor, clones, layout, hosts,
                 control_failed, device: torch.device = torch.device("cpu"), disk=None, twins: bool = False) -> None:
        self.box, self.executor, self.clones, self.layout, self.hosts = mailbox, executor, clones, layout, hosts
        self.L, self.K, self.R, self.rows, self.H, self.device = mailbox.L, mailbox.K, RING, mailbox.rows, \
            hidden_size, device
        n, pin = self.R * self.L, device.type == "cuda"
        ring = lambda shape, dt, fill=0: torch.full(shape, fill, dtype=dt, pin_memory=pin)  # noqa: E731
        self.x, self.out = ring((n, self.rows * hidden_size), dtype), ring((n, self.rows * hidden_size), dtype)
        self.index = ring((n, self.rows * self.K), torch.int64)
        self.weights = ring((n, self.rows * self.K), torch.float64)  # holds any routing dtype exactly
        self.E = hosts[0].shape[0]
        self.on_host = ring((n, self.E), torch.uint8)  # [E] per slot: 1 where the host computes, 2 a twin
        self.twins = twins
        self.cache, self._table = disk if disk is not None else (None, None)
        self.hrow = ring((n, self.E), torch.int32, -1) if disk is not None else None  # [E] per slot: host-cache rows
        self._hrow_np = self.hrow.numpy() if disk is not None else None
        self._held: list[int] = []  # host-cache rows pinned for the last decision
        self.seqs = ring((3, n), torch.int64, -1)  # the step whose (hidden state, decision, output) a slot holds
        self.status = ring((3,), torch.int64)  # kernels.relay's FALLBACKS, FAILURES, ABORT
        self.xseq, self.dseq, self.oseq = self.seqs.numpy()
        self._on_host_np, self.status_np = self.on_host.numpy(), self.status.numpy()
        self._control_failed = control_failed
        self._weights_dtype = torch.float32
        self._open = (0, 0)  # (slot, step) of the experts call between enter and leave (CPU side)
        self.kernels: RelayKernels | None = None
        self.closed_through = -1  # steps the model thread has closed: their jobs may give up
        self.error: BaseException | None = None
        self.experts = 0  # experts computed through the relay
        self.dropped_jobs = 0  # jobs given up: their step ended without posting its hidden state
        if pin:
            self.use_kernels()

    def use_kernels(self, **spins) -> None:
        """Run the step's side as device kernels (on CUDA always; on the CPU only under
        TRITON_INTERPRET=1, to test them); `spins`: `RelayKernels`' bounds."""
        self.kernels = RelayKernels(self, self.device, **spins)
        self.kernels.warm()

    @property
    def active(self) -> bool:
        """A posting step that really posts is running (not a graph warm-up)."""
        return not self.box.muted

    # -- the step's side (model thread) -------------------------------------------------------------
    def enter(self, layer: int, x: torch.Tensor, index: torch.Tensor,
              weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Post the experts call of `layer` in the running step ([B, H] hidden states, [B, K] routed
        ids and weights) and wait for the decision: (the weights with the host's positions at 0,
        [B x K] bool: the positions the host or a twin serves, whose rows the step need not read, [B x K]
        the host-cache row of each position's expert with a disk tier, else None, [B x K] bool: the
        positions twins serve with the twin path, else None)."""
        if x.dtype != self.x.dtype:  # the host must compute from exactly the call's numbers
            raise UserError(f"hidden states in {x.dtype} but experts in {self.x.dtype}: the host path of a posted "
                            "step needs one dtype; load the model in one dtype, or use control='inline'")
        self._weights_dtype = weights.dtype
        if self.kernels is not None:
            self.kernels.post(layer, x, index, weights)
            kept, flags, rows = self.kernels.keep(layer, index, weights)
            return kept, flags != 0, rows, (flags == 2) if self.twins else None
        step = (int(self.box.posts.item()) - 1) // self.L  # the router of `layer` has posted already
        at, b = (step % self.R) * self.L + layer, index.shape[0]
        self.x[at, :x.numel()].copy_(x.reshape(-1))
        self.index[at, :b * self.K].copy_(index.reshape(-1))
        self.weights[at, :b * self.K].copy_(weights.reshape(-1))
        self.xseq[at] = step  # after the data
        self._open = (at, step, b)
        self._wait(self.dseq, at, step)
        flags = self.on_host[at][index]
        keep = flags == 0
        rows = None if self.hrow is None else self.hrow[at][index].reshape(-1).long()
        return torch.where(keep, weights, 0), ~keep.view(-1), rows, (flags == 2).view(-1) if self.twins else None

    def leave(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """`out` plus the host's summed output of the call `enter` posted (waits for it)."""
        if self.kernels is not None:
            return self.kernels.add(layer, out)
        at, step, b = self._open
        self._wait(self.oseq, at, step)
        return out + self.out[at, :b * self.H].view(b, -1).to(out.dtype)

    def check(self) -> None:
        """RuntimeError if a device-side wait gave up on a host output (that layer's output is NaN)."""
        failed = int(self.status_np[FAILURES])
        if failed:
            why = f" (the host path stopped: {self.error!r})" if self.error is not None else ""
            raise RuntimeError(f"{failed} decode-step layer(s) got no host output in time{why}: their outputs are "
                               "NaN, not the model's; restore() and offload the model again") from self.error

    @property
    def fallbacks(self) -> int:
        """Layers whose decision did not come in time: the step computed every routed expert itself."""
        return int(self.status_np[FALLBACKS])

    def abort(self) -> None:
        """End every device-side wait at once, now and later (the host side stopped)."""
        self.status_np[ABORT] = 1

    def close_step(self, step: int) -> None:
        """The model thread is done with `step` (it returned, or was cut short)."""
        self.closed_through = max(self.closed_through, step)

    def _wait(self, seq: np.ndarray, at: int, step: int) -> None:
        end = time.perf_counter() + STEP_WAIT_S
        if not _spin(seq, at, step, lambda: self.error is not None or self._control_failed()
                     or time.perf_counter() > end):
            why = self.error or ("control thread stopped" if self._control_failed() else f"no answer in {STEP_WAIT_S} s")
            raise RuntimeError(f"decode step {step}: the host path stopped ({why!r}); restore() and offload the "
                               "model again") from self.error

    # -- the control thread's side --------------------------------------------------------------------
    def decide(self, step: int, layer: int, host_ids: list[int], rows: int = 1, routed: np.ndarray | None = None,
               twin_ids: list[int] = ()) -> None:
        """The state machine sent experts `host_ids` of `layer` to the host CPU and `twin_ids` to their
        twins for `step` (of `rows` rows); `routed`: the layer's routed ids (a disk tier holds the rows
        the step reads in place)."""
        at = (step % self.R) * self.L + layer
        if self.cache is not None:
            self._hold_rows(at, layer, routed, list(host_ids) + list(twin_ids))
        row = self._on_host_np[at]
        row[:] = 0
        row[host_ids] = 1
        row[list(twin_ids)] = 2
        if not host_ids:
            self.out[at, :rows * self.H].zero_()
        _store_fence()
        self.dseq[at] = step
        if not host_ids:
            self.oseq[at] = step
            return
        self.executor.call(self._compute, step, layer, at, host_ids, rows)

    def _hold_rows(self, at: int, layer: int, routed: np.ndarray, host_ids: list[int]) -> None:
        """Pin the host-cache row of each routed expert of `layer` without a published slot and not
        served off the device's read (`host_ids`: the host CPU's and the twins'), and write the rows for
        the step (the previous decision's are released: the step that read them has posted since)."""
        self.release_rows()
        hrow, base = self._hrow_np[at], layer * self.E
        hrow[:] = -1
        wanted = [int(e) for e in np.unique(routed) if self._table[layer, e] < 0 and e not in host_ids]
        if len(wanted) >= self.cache.tier.rows:
            raise UserError(f"a decode step reads {len(wanted)} experts of one layer from the host cache, which holds "
                            f"{self.cache.tier.rows} rows: give more host_memory, or decode fewer sequences at once")
        for e in wanted:
            row = self.cache.pin(base + e)  # waits for its read from disk
            self._held.append(row)
            hrow[e] = row

    def release_rows(self) -> None:
        """The host-cache rows pinned for the last decision may change hands (its step read them)."""
        held, self._held = self._held, []
        for row in held:
            self.cache.unpin(row)

    def _compute(self, step: int, layer: int, at: int, host_ids: list[int], rows: int) -> None:
        """One job on the host worker: wait for the hidden state, compute, post the sum."""
        try:
            if not _spin(self.xseq, at, step, lambda: step <= self.closed_through or self._control_failed()):
                self.dropped_jobs += 1  # the step ended without posting it, or the runtime is closing
                return
            x = self.x[at, :rows * self.H].view(rows, self.H).clone()
            index = self.index[at, :rows * self.K].view(rows, self.K).clone()
            w = self.weights[at, :rows * self.K].view(rows, self.K).to(self._weights_dtype)
            out = self.executor.compute(self.clones[layer], self.layout, self.hosts[layer], host_ids, x, index, w)
            self.out[at, :out.numel()].copy_(out.reshape(-1))
            self.experts += len(host_ids)
            _store_fence()
            self.oseq[at] = step  # after the data
        except BaseException as e:  # the step's wait raises it (on a device: `check`)
            self.error = e
            self.abort()


_FENCE = threading.Lock()


def _store_fence() -> None:
    """Every store before is visible before any after (a lock's full barrier: a large copy may use
    weakly ordered streaming stores, and a device reads these flags)."""
    with _FENCE:
        pass


def _spin(seq: np.ndarray, at: int, step: int, give_up) -> bool:
    """Wait until seq[at] == step; False once `give_up()` is true while waiting."""
    spins = 0
    while int(seq[at]) != step:
        spins += 1
        if spins > SPINS:
            time.sleep(NAP_S)
            if give_up():
                return False
    return True

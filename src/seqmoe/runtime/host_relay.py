"""The host CPU path of a posted decode step (`control="thread"`): the routed experts the memory
manager sends to the host CPU are computed there while the step computes the others, and the step
reads no host value to learn which or to get their output.

    # the step (model thread), in a posting forward's experts call of `layer`:
    at, step = relay.post_hidden(layer, x, index, weights)   # the call's inputs to mapped memory
    keep = relay.keep(at, step, index)   # waits for the decision: [1, K], False where the host computes
    out = device_part(x, index, weights * keep) + relay.host_out(at, step)   # waits for the host's sum
    # the control thread, after the state machine's reveal of (step, layer):
    relay.decide(step, layer, host_ids)

Three rings of (mapped) host memory, R steps x L layers like the routing mailbox's, each slot with
the number of the step it holds, written after its data (stream order on a device, program order
on the host), so a reader that sees the step's number sees its data: the experts call's inputs
(hidden state, routed ids and weights, posted by the step before it waits for anything: the host
computes from exactly what the call got), the decision (which of the layer's E experts the host
computes), and the host's summed output (zeros, flagged with the decision, when the host computes
none). The host's positions get weight 0 in the step's own experts call: their rows are still
read (real weights, so an exact 0 is added), which on the CPU costs a memory read.

The host worker (`HostExecutor`'s one thread) waits for the hidden state of each job; a job whose
step ended without posting it (an error or Ctrl-C mid-step) gives up once the model thread closes
that step (`close_step`) or the control thread stops (the runtime closing). The step's own waits
give up with an error when the control thread or a host job has failed: no wait outlives its partner.

On the CPU backend the waits spin on numpy views of the rings. A CUDA step would wait in a kernel
spinning on the mapped flags; that kernel is not built, and `offload` refuses the host path in a
posted step on CUDA.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from seqmoe.errors import UserError

SPINS = 200
"""Tight polls before each wait starts sleeping between polls."""
NAP_S = 20e-6
STEP_WAIT_S = 60.0
"""The longest a step waits for a decision or an output before it raises (a stalled partner is a bug)."""


class HostRelay:
    """The rings and both sides of the protocol above, for one runtime.

    Args:
        mailbox: the routing mailbox (its ring size, L, K, and the device's count of layers posted).
        hidden_size, dtype: of the hidden states and outputs.
        executor: the `HostExecutor` whose thread computes host experts.
        twins: one `HostExecutor.twin` of each layer's experts module.
        layout, hosts: the packed expert layout and each layer's [E, P] host block.
        control_failed: true once the control thread has stopped or failed (the step's waits give up).
    """

    def __init__(self, mailbox, hidden_size: int, dtype: torch.dtype, executor, twins, layout, hosts,
                 control_failed) -> None:
        self.box, self.executor, self.twins, self.layout, self.hosts = mailbox, executor, twins, layout, hosts
        self.L, self.K, self.R = mailbox.L, mailbox.K, mailbox.R
        n = self.R * self.L
        self._x = torch.zeros((n, hidden_size), dtype=dtype)
        self._index = torch.zeros((n, self.K), dtype=torch.int64)
        self._weights = torch.zeros((n, self.K), dtype=torch.float64)  # holds any routing dtype exactly
        self._out = torch.zeros((n, hidden_size), dtype=dtype)
        self._on_host = torch.zeros((n, hosts[0].shape[0]), dtype=torch.bool)  # [E] per slot
        self._xseq, self._dseq, self._oseq = (np.full(n, -1, np.int64) for _ in range(3))
        self._on_host_np = self._on_host.numpy()
        self._control_failed = control_failed
        self._weights_dtype = torch.float32
        self.closed_through = -1  # steps the model thread has closed: their jobs may give up
        self.error: BaseException | None = None
        self.experts = 0  # experts computed through the relay
        self.dropped_jobs = 0  # jobs given up: their step ended without posting its hidden state

    @property
    def active(self) -> bool:
        """A posting step that really posts is running (not a graph warm-up)."""
        return not self.box.muted

    # -- the step's side (model thread) -------------------------------------------------------------
    def post_hidden(self, layer: int, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple[int, int]:
        """Post the experts call of `layer` in the running step ([1, H] hidden state, [1, K] routed
        ids and weights); (its ring slot, the step)."""
        if x.dtype != self._x.dtype:  # the host must compute from exactly the call's numbers
            raise UserError(f"hidden states in {x.dtype} but experts in {self._x.dtype}: the host path of a posted "
                            "step needs one dtype; load the model in one dtype, or use control='inline'")
        step = (int(self.box.posts.item()) - 1) // self.L  # the router of `layer` has posted already
        at = (step % self.R) * self.L + layer
        self._weights_dtype = weights.dtype
        self._x[at].copy_(x.reshape(-1))
        self._index[at].copy_(index.reshape(-1))
        self._weights[at].copy_(weights.reshape(-1))
        self._xseq[at] = step  # after the data
        return at, step

    def keep(self, at: int, step: int, index: torch.Tensor) -> torch.Tensor:
        """[1, K] bool: the routed positions of `index` the step computes itself (waits for the decision)."""
        self._wait(self._dseq, at, step)
        return ~self._on_host[at][index.reshape(1, self.K)]

    def host_out(self, at: int, step: int) -> torch.Tensor:
        """[1, H] the host's summed output for the slot (waits for it)."""
        self._wait(self._oseq, at, step)
        return self._out[at].view(1, -1).clone()

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
    def decide(self, step: int, layer: int, host_ids: list[int]) -> None:
        """The state machine sent experts `host_ids` of `layer` to the host CPU for `step`."""
        at = (step % self.R) * self.L + layer
        row = self._on_host_np[at]
        row[:] = False
        row[host_ids] = True
        if not host_ids:
            self._out[at].zero_()
        self._dseq[at] = step
        if not host_ids:
            self._oseq[at] = step
            return
        self.executor.call(self._compute, step, layer, at, host_ids)

    def _compute(self, step: int, layer: int, at: int, host_ids: list[int]) -> None:
        """One job on the host worker: wait for the hidden state, compute, post the sum."""
        try:
            if not _spin(self._xseq, at, step, lambda: step <= self.closed_through or self._control_failed()):
                self.dropped_jobs += 1  # the step ended without posting it, or the runtime is closing
                return
            x, index = self._x[at:at + 1].clone(), self._index[at:at + 1].clone()
            w = self._weights[at:at + 1].to(self._weights_dtype)
            out = self.executor.compute(self.twins[layer], self.layout, self.hosts[layer], host_ids, x, index, w)
            self._out[at].copy_(out.reshape(-1))
            self.experts += len(host_ids)
            self._oseq[at] = step  # after the data
        except BaseException as e:  # the step's wait raises it
            self.error = e


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

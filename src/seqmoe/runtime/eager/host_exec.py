"""The host expert executor: routed experts computed on the CPU, next to their host weights.

When the memory manager serves a miss on the host CPU (`miss="cpu"` or `"auto"`,
`seqmoe.manager.miss_paths`), the layer's experts split in two: the device computes the experts in
slots (or read in place) while this executor's one worker thread computes the others from views of
their host rows (no copy) and hands back their summed output, which the device adds. Each host
expert runs the model's own experts forward on a one-expert view, every routed slot pointing at it
and every other slot's weight set to 0 (adding an exact 0; the implementations' sentinel index is
not usable here: grouped_mm's histogram of one bin then counts it), so the math is the original's;
only the order of the final sum differs from full load.

One thread: at batch 1 an expert is a pass over its weights at the host's memory bandwidth, which
torch's own intra-op threads already use (`benchmarks/host_expert.py`); a second host expert at once
would not finish either sooner. With the benchmark's emulated link the worker also sleeps the cost
model's host time per expert (`seqmoe.host_cost`), as the link sleeps a copy time.
Where it sits in a decode step: docs/decode.md.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class HostExecutor:
    """One worker thread computing host-served experts.

    Args:
        emulated_s: seconds slept per expert (the emulated host time), 0 for none.
    """

    def __init__(self, emulated_s: float = 0.0) -> None:
        self.emulated_s = emulated_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seqmoe-host")
        self.experts = 0  # experts computed here so far

    @staticmethod
    def clone(original: torch.nn.Module) -> torch.nn.Module:
        """A shallow copy of an experts module with its own attribute dict, for `submit` (the device
        part runs `original` meanwhile); one per layer, reused: a layer waits for its host part."""
        return copy.copy(original)

    def submit(self, clone: torch.nn.Module, layout, host_rows: torch.Tensor, ids: list[int],
               hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> Future:
        """Compute experts `ids` (of `host_rows`, the layer's [E, P] host block) for the routed `index`
        with `weights` on `clone` (`HostExecutor.clone`); a future of their summed output (on the host,
        in `hidden_states`' dtype)."""
        x, idx, w = hidden_states.cpu(), index.cpu(), weights.cpu()
        return self._pool.submit(self.compute, clone, layout, host_rows, ids, x, idx, w)

    def call(self, fn, *args) -> Future:
        """Run `fn(*args)` on the worker thread, after the work handed over before it."""
        return self._pool.submit(fn, *args)

    def compute(self, clone, layout, host_rows, ids, x, idx, w) -> torch.Tensor:
        """`submit`'s work, on the calling thread (the worker's): host tensors in, their sum out."""
        t0 = time.perf_counter()
        state, forward, out = clone.__dict__, type(clone).forward, None
        state["num_experts"] = 1
        with torch.no_grad():
            for e in ids:
                state.update(layout.views(host_rows[e:e + 1]))  # a view of the host row: no copy
                one = forward(clone, x, torch.zeros_like(idx), torch.where(idx == e, w, 0))
                out = one if out is None else out + one
        if self.emulated_s:
            time.sleep(max(0.0, len(ids) * self.emulated_s - (time.perf_counter() - t0)))
        self.experts += len(ids)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)

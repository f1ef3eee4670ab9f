"""The host expert executor: routed experts computed on the CPU, next to their host weights.

When the memory manager serves a miss on the host CPU (`miss="cpu"` or `"auto"`,
`seqmoe.brain.manager.miss_paths`), the layer's experts split in two: the device computes the experts in
slots (or read in place) while this executor's one worker thread computes the others from views of
their host rows (no copy) and hands back their summed output, which the device adds. Each host
expert runs the model's own experts forward on a one-expert view, every routed slot pointing at it
and every other slot's weight set to 0 (adding an exact 0; the implementations' sentinel index is
not usable here: grouped_mm's histogram of one bin then counts it), so the math is the original's;
only the order of the final sum differs from full load.

One thread: at batch 1 an expert is a pass over its weights at the host's memory bandwidth, which
torch's own intra-op threads already use (`benchmarks/host_expert.py`); a second host expert at once
would not finish either sooner. With the benchmark's emulated link the worker also sleeps the cost
model's host time per expert (`seqmoe.costs.host_cost`), as the link sleeps a copy time.

A call of many rows (a prompt, a batch) computes each expert on the rows routed to it only, one
routing column each (the same products, summed into zeros: exact), not on every row at weight 0;
its emulated time is the caller's (`PromptCosts.host_s`: it grows with the rows).
Where it sits in a decode step: docs/decode.md.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from seqmoe.arch import model_arch
from seqmoe.runtime.core.costs import measure_host_expert_s


class HostExecutor:
    """One worker thread computing host-served experts.

    Args:
        emulated_s: seconds slept per expert (the emulated host time), 0 for none.
    """

    def __init__(self, emulated_s: float = 0.0) -> None:
        self.emulated_s = emulated_s
        self.prompt = None  # seqmoe.costs.host_cost.PromptCosts: how a prompt splits its misses (`price_prompts`)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seqmoe-host")
        self.experts = 0  # experts computed here so far

    def price_prompts(self, costs) -> None:
        """Split a prompt's misses between the link and this CPU by `costs` (`seqmoe.costs.host_cost.PromptCosts`,
        known once the cost model is measured)."""
        self.prompt = costs

    @staticmethod
    def clone(original: torch.nn.Module) -> torch.nn.Module:
        """A shallow copy of an experts module with its own attribute dict, for `submit` (the device
        part runs `original` meanwhile); one per layer, reused: a layer waits for its host part."""
        return copy.copy(original)

    def submit(self, clone: torch.nn.Module, layout, host_rows: torch.Tensor, ids: list[int],
               hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
               emulated_s: float | None = None) -> Future:
        """Compute experts `ids` (of `host_rows`, the layer's [E, P] host block) for the routed `index`
        with `weights` on `clone` (`HostExecutor.clone`); a future of their summed output (on the host,
        in `hidden_states`' dtype). `emulated_s`: the emulated time of the whole call (default: `emulated_s` per expert)."""
        x, idx, w = hidden_states.cpu(), index.cpu(), weights.cpu()
        return self._pool.submit(self.compute, clone, layout, host_rows, ids, x, idx, w, emulated_s)

    def call(self, fn, *args) -> Future:
        """Run `fn(*args)` on the worker thread, after the work handed over before it."""
        return self._pool.submit(fn, *args)

    def compute(self, clone, layout, host_rows, ids, x, idx, w, emulated_s: float | None = None) -> torch.Tensor:
        """`submit`'s work, on the calling thread (the worker's): host tensors in, their sum out."""
        t0 = time.perf_counter()
        state, forward, out = clone.__dict__, type(clone).forward, None
        state["num_experts"] = 1
        many = x.shape[0] > 1
        with torch.no_grad():
            for e in ids:
                state.update(layout.views(host_rows[e:e + 1]))  # a view of the host row: no copy
                if not many:  # one row: every slot, the others at weight 0
                    one = forward(clone, x, torch.zeros_like(idx), torch.where(idx == e, w, 0))
                    out = one if out is None else out + one
                    continue
                out = torch.zeros_like(x) if out is None else out
                rows, col = torch.nonzero(idx == e, as_tuple=True)  # the rows routed to e, each once (top-k ids differ)
                if len(rows):
                    one = forward(clone, x[rows], torch.zeros_like(idx[rows, :1]), w[rows, col].unsqueeze(1))
                    out.index_add_(0, rows, one)
        if self.emulated_s:
            want = len(ids) * self.emulated_s if emulated_s is None else emulated_s
            time.sleep(max(0.0, want - (time.perf_counter() - t0)))
        self.experts += len(ids)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def model_host_expert_s(model) -> float:
    """`measure_host_expert_s` for a model that is not offloaded: one expert of its first MoE layer,
    packed into host memory for the measurement, round trip from the model's device."""
    arch = model_arch(model)
    experts = arch.moe[0].experts
    layout = arch.layout(experts)
    rows = torch.empty((experts.num_experts, layout.numel), dtype=layout.dtype)
    layout.pack(experts, rows)
    executor = HostExecutor()
    try:
        return measure_host_expert_s(executor, HostExecutor.clone(experts), layout, rows, model.config.hidden_size,
                                     arch.top_k, next(experts.parameters()).device)
    finally:
        executor.close()

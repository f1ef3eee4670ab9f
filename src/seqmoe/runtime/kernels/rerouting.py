"""Cache-aware routing (`seqmoe.brain.rerouting`) as one device kernel, for posted decode steps on
CUDA: the router's output is rewritten on the device from the pool's mapped state, so the step
reads no host value and stays capturable.

    rule = DeviceCacheRouting(max_kl, pool, top_k)      # needs triton (on the CPU: TRITON_INTERPRET=1)
    weights, ids = rule(layer, logits, weights, ids)     # [B, E] logits, [B, K] weights and ids

The same rule as `CacheAwareRouting.substitute` on each of a step's B rows in turn (one program:
the counts take no atomics), in float64: missing = the expert
holds no slot (`ExpertPool.assigned`), readable = its table entry is published; missing routed
experts are taken cheapest first, each swapped for the most likely readable expert not routed,
while the row's token's KL budget (kept on the device per row, reset at layer 0) holds; the weights follow the
router's own rule. A router whose weights are not its softmax times one factor cannot be refused
by raising here: its routing is left exact and counted (`counts()["refused"]`), and `stats` of
the runtime show it. The counts are mapped host memory the kernel writes, read without a sync.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from seqmoe.runtime.core.mapped import device_view

COUNTS = ("substitutions", "kl_total", "tokens", "activations", "refused")
"""The words of the mapped counts, in order."""


class DeviceCacheRouting:
    """The kernel bound to one runtime's pool.

    Args:
        max_kl: nats of KL each token may spend over its layers.
        pool: the `ExpertPool` (its mapped slot table and assigned mask).
        top_k: K.
        rows: the most rows a step has (the mailbox's).
    """

    def __init__(self, max_kl: float, pool, top_k: int, rows: int = 1) -> None:
        self.max_kl, self.pool, self.K = float(max_kl), pool, top_k
        self.E, device = pool.num_experts, pool.device
        counts = torch.zeros((len(COUNTS),), dtype=torch.float64, pin_memory=device.type == "cuda")
        self._counts_np, self._counts = counts.numpy(), device_view(counts, device)
        # the budget, then each row's token's KL spent so far (a Python float would reach the kernel as float32)
        self._state = torch.tensor([self.max_kl] + [0.0] * rows, dtype=torch.float64, device=device)
        self._out: dict[tuple[torch.dtype, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.k = _build()

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """(weights, ids) of a step's B rows at `layer`, rewritten on the device (shared buffers)."""
        b = ids.reshape(-1, self.K).shape[0]
        key = (weights.dtype, ids.dtype, b)
        if key not in self._out:
            dev = weights.device
            self._out[key] = (torch.empty((b, self.K), dtype=weights.dtype, device=dev),
                              torch.empty((b, self.K), dtype=ids.dtype, device=dev))
        out_w, out_ids = self._out[key]
        self.k[(1,)](logits.reshape(-1).contiguous(), weights.reshape(-1).contiguous(), ids.reshape(-1).contiguous(),
                     self.pool.assigned, self.pool.table, self._state, self._counts, out_w, out_ids, layer, self.E,
                     self.K, b, BE=max(2, 1 << (self.E - 1).bit_length()),
                     BK=max(2, 1 << (self.K - 1).bit_length()))
        return out_w, out_ids

    def counts(self) -> dict:
        """What the kernel counted, as the host sees it now (it may lag the device by a step)."""
        return dict(zip(COUNTS, np.asarray(self._counts_np).tolist()))


@functools.cache
def _build():
    import triton  # triton: only when this runs
    import triton.language as tl  # triton: only when this runs

    @triton.jit(do_not_specialize=["layer"])
    def substitute(logits, weights, ids, assigned, table, state, counts, out_w, out_ids, layer, E, K, B,
                   BE: tl.constexpr, BK: tl.constexpr):
        for row in range(0, B):  # the rows in turn: the counts take no atomics
            used = state + 1 + row
            e = tl.arange(0, BE)
            me = e < E
            k = tl.arange(0, BK)
            mk = k < K
            z = tl.load(logits + row * E + e, mask=me, other=float("-inf")).to(tl.float64)
            p = tl.where(me, tl.exp(z - tl.max(z, axis=0)), 0.0)
            p = p / tl.sum(p, axis=0)  # the router's softmax
            sel = tl.load(ids + row * K + k, mask=mk, other=0).to(tl.int64)
            w = tl.load(weights + row * K + k, mask=mk, other=0.0).to(tl.float64)
            missing = tl.load(assigned + layer * E + e, mask=me, other=1, volatile=True) == 0
            readable = tl.load(table + layer * E + e, mask=me, other=-1, volatile=True) >= 0
            hit = (sel[:, None] == e[None, :]) & mk[:, None]  # [BK, BE]: position k routes to expert e
            psel = tl.sum(tl.where(hit, p[None, :], 0.0), axis=1)
            miss_sel = tl.sum(tl.where(hit & missing[None, :], 1, 0), axis=1) > 0
            free = readable & me & (tl.sum(tl.where(hit, 1, 0), axis=0) == 0)
            first = layer == 0
            u0 = tl.where(first, 0.0, tl.load(used))
            max_kl = tl.load(state)
            u = u0
            new = sel
            done = ~mk
            subs = 0
            spent = 0.0
            for r in tl.static_range(BK):  # the routed positions, cheapest first (ties: the lower position)
                j = tl.argmin(tl.where(done, float("inf"), psel), axis=0)
                at = k == j
                done = done | at
                pe = tl.sum(tl.where(at, psel, 0.0), axis=0)
                is_missing = tl.sum(tl.where(at & miss_sel, 1, 0), axis=0) > 0
                c = tl.argmax(tl.where(free, p, -1.0), axis=0)
                pc = tl.sum(tl.where(e == c, p, 0.0), axis=0)
                kl = (pe - pc) * tl.log(pe / pc)
                ok = (r < K) & is_missing & (tl.sum(free.to(tl.int32), axis=0) > 0) & ~(u + kl > max_kl)
                new = tl.where(at & ok, c, new)
                free = free & ~((e == c) & ok)
                u = tl.where(ok, u + kl, u)
                spent = tl.where(ok, spent + kl, spent)
                subs = subs + ok.to(tl.int32)
            scale = w / psel
            s0 = tl.sum(tl.where(k == 0, scale, 0.0), axis=0)
            consistent = tl.sum(tl.where(mk & (tl.abs(scale - s0) > 1e-6 + 1e-3 * tl.abs(s0)), 1, 0), axis=0) == 0
            total = tl.sum(w, axis=0)
            unit = tl.sum(tl.where(mk & (tl.abs(scale - 1.0) > 1e-6 + 1e-5), 1, 0), axis=0) == 0
            renormalised = (tl.abs(total - 1.0) <= 1e-4 + 1e-5) & ~unit
            chosen = tl.sum(tl.where((new[:, None] == e[None, :]) & mk[:, None], p[None, :], 0.0), axis=1)
            new_w = tl.where(renormalised, chosen / tl.sum(chosen, axis=0), s0 * chosen)
            changed = subs > 0
            apply = changed & consistent
            tl.store(out_ids + row * K + k, tl.where(apply, new, sel), mask=mk)
            tl.store(out_w + row * K + k, tl.where(apply, new_w, w), mask=mk)
            tl.store(used, tl.where(apply, u, u0))
            tl.store(counts + 0, tl.load(counts + 0) + tl.where(apply, subs, 0).to(tl.float64))
            tl.store(counts + 1, tl.load(counts + 1) + tl.where(apply, spent, 0.0))
            tl.store(counts + 2, tl.load(counts + 2) + first.to(tl.float64))
            tl.store(counts + 3, tl.load(counts + 3) + K)
            tl.store(counts + 4, tl.load(counts + 4) + (changed & ~consistent).to(tl.float64))
            tl.debug_barrier()  # the next row reads the counts this one wrote

    return substitute

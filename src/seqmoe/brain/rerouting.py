"""Cache-aware routing: a routed expert that is not in the pool may be swapped for a resident expert
of the same layer that the router scored close to it, within a per-token quality budget.

    rt = seqmoe.offload(model, 0.25, routing="cache-aware", max_kl=0.05)      # live
    seqmoe sim ... --routing cache-aware --max-kl 0.05                          # replayed (traces with router_logits)

Exact by default (`routing="exact"`). The router's distribution at a position is P = softmax of
its logits over the E experts. Routing to a resident expert c instead of a missing routed expert e
is what the router would do had it scored the two the other way round: Q is P with p_e and p_c
swapped, and that substitution costs KL(P || Q) = (p_e - p_c) log(p_e / p_c) (the same both ways,
0 when the scores tie). Each token has `max_kl` to spend over all its MoE layers; at each layer the
missing routed experts are taken cheapest first (smallest p_e first), each swapped for the most
likely resident expert the router did not pick, while the token's budget holds. The weights are
the router's own rule applied to the new set: the softmax probabilities, renormalised over the
set when the router renormalises its top-k (seqmoe-tiny, Mixtral), scaled alike otherwise.

The simulator replays the rule on a trace's recorded router logits (`RoutingTrace.router_logits`)
against its own pool. A substitution there changes the layer it happens in; the later routing is
the recorded one, where live the substituted expert's output would shift the next layers' inputs a
little (the runtime measures that cost; the replay counts misses and KL).

Only routers whose top-k weights are softmax(logits) of the chosen experts (times one factor) can
be served; others raise UserError at the first call. Cache-conditional experts (Skliar et al.)
and Strata's resident bias are the anchors; their budgets are a bias on the scores, ours a KL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from seqmoe.base.errors import UserError

if TYPE_CHECKING:
    import torch

ROUTINGS = ("exact", "cache-aware")
"""The routing modes; the first is the default."""


def check_routing(routing: str, max_kl: float | None) -> None:
    """UserError for an unknown routing mode or a budget that does not fit it."""
    if routing not in ROUTINGS:
        raise UserError(f"unknown routing {routing!r}; choose one of: {', '.join(ROUTINGS)}")
    if routing == "exact" and max_kl is not None:
        raise UserError("max_kl (--max-kl) is the budget of cache-aware routing; exact routing has none")
    if routing == "cache-aware" and (max_kl is None or not max_kl >= 0):
        raise UserError(f"cache-aware routing needs its budget max_kl (--max-kl) >= 0, in nats per token; got {max_kl!r}")


class CacheAwareRouting:
    """The substitution rule of the module doc; its counts over the positions it saw.

    Args:
        max_kl: nats of KL(P || Q) each token may spend over its layers.
        missing: missing(layer) -> [E] bool, the experts of `layer` that are not in the pool
            (neither resident nor being copied in).
        resident: resident(layer) -> [E] bool, the experts of `layer` readable now.
        posted: the rule for posted steps on a device (`runtime.kernels.rerouting`), or None.
    """

    def __init__(self, max_kl: float, missing, resident, posted=None) -> None:
        self.max_kl = float(max_kl)
        self._missing, self._resident = missing, resident
        self.posted = posted
        self._used = np.zeros(0)
        self.activations = self.substitutions = 0
        self.kl_total = 0.0
        self.tokens = 0

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 posted: bool = False):
        """(weights, ids) to route with at `layer`: the router's, or with substitutions (tensors);
        `posted`: in a posted decode step, which on a device reads no host value (`self.posted`)."""
        import torch  # torch: only when this runs

        if posted and self.posted is not None:
            return self.posted(layer, logits, weights, ids)
        got = self.substitute(layer, lambda: logits.detach().double().cpu().numpy(),
                              lambda: weights.detach().double().cpu().numpy(), ids.detach().cpu().numpy())
        if got is None:
            return weights, ids
        new_w, new_idx = got
        return torch.as_tensor(new_w, dtype=weights.dtype).to(weights.device), \
            torch.as_tensor(new_idx, dtype=ids.dtype).to(ids.device)

    def substitute(self, layer: int, logits, weights, ids: np.ndarray):
        """The rule on host arrays: `ids` [N, K]; `logits`, `weights`: callables giving [N, E] and
        [N, K] float64 (asked only when some routed expert is missing). (new weights, new ids), or
        None when nothing changes."""
        n = ids.shape[0]
        if layer == 0:  # a forward's first MoE layer: its positions are new tokens
            self._used = np.zeros(n)
            self.tokens += n
        self.activations += ids.size
        missing = self._missing(layer)
        idx = ids.astype(np.int64)
        if not missing[idx].any():
            return None
        z = logits()
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)  # [N, E], the router's softmax
        resident = self._resident(layer)
        new_idx, changed = idx.copy(), False
        before = self._used.copy(), self.substitutions, self.kl_total
        for i in range(n):
            changed |= self._substitute(p[i], new_idx[i], missing, resident, i)
        if not changed:
            return None
        try:
            return self._weights(p, idx, weights(), new_idx), new_idx
        except UserError:  # a router the rule cannot serve: nothing was substituted
            self._used, self.substitutions, self.kl_total = before
            raise

    def _substitute(self, p: np.ndarray, sel: np.ndarray, missing: np.ndarray, resident: np.ndarray, i: int) -> bool:
        free = resident.copy()
        free[sel] = False
        changed = False
        for j in np.argsort(p[sel], kind="stable"):
            e = sel[j]
            if not missing[e] or not free.any():
                continue
            c = int(np.argmax(np.where(free, p, -1.0)))
            with np.errstate(divide="ignore"):  # p_c may underflow to 0: an infinite cost
                kl = (p[e] - p[c]) * np.log(p[e] / p[c])
            if self._used[i] + kl > self.max_kl:
                continue
            sel[j], free[c] = c, False
            self._used[i] += kl
            self.kl_total += kl
            self.substitutions += 1
            changed = True
        return changed

    @staticmethod
    def _weights(p: np.ndarray, idx: np.ndarray, w: np.ndarray, new_idx: np.ndarray) -> np.ndarray:
        rows = np.arange(len(idx))[:, None]
        scale = w / p[rows, idx]
        if not np.allclose(scale, scale[:, :1], rtol=1e-3, atol=1e-6):
            raise UserError("cache-aware routing needs a router whose top-k weights are its softmax probabilities "
                            "(times one factor); this router's are not")
        renormalised = np.allclose(w.sum(axis=1), 1.0, atol=1e-4) and not np.allclose(scale, 1.0, atol=1e-6)
        chosen = p[rows, new_idx]
        return chosen / chosen.sum(axis=1, keepdims=True) if renormalised else scale[:, :1] * chosen

    def stats(self) -> dict:
        """substitution_rate (of routed activations), mean_kl (nats per token), and the counts (with
        the posted steps' rule's: `refused` counts its positions left exact by a router it cannot serve)."""
        dev = self.posted.counts() if self.posted is not None else {}
        subs, kl = self.substitutions + int(dev.get("substitutions", 0)), self.kl_total + dev.get("kl_total", 0.0)
        tokens, acts = self.tokens + int(dev.get("tokens", 0)), self.activations + int(dev.get("activations", 0))
        return {"routing": "cache-aware", "max_kl": self.max_kl, "substitutions": subs,
                "substitution_rate": subs / acts if acts else 0.0, "mean_kl": float(kl / tokens) if tokens else 0.0,
                **({"refused": int(dev["refused"])} if dev else {})}

"""The cache-aware routing kernel (`routing_device`) against the host rule (`CacheAwareRouting`),
position by position, on the CPU under TRITON_INTERPRET=1: random logits, pool states, budgets,
tokens of several layers (the budget carries over), routers that renormalise, scale, or cannot
be served; then whole posted decode steps substituting through it (`posted_steps_replay`).

    python -m tests.runtime.routing_interp_check      # prints "ok"; run by test_cache_routing.py when triton is installed
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from seqmoe.brain.rerouting import CacheAwareRouting  # noqa: E402
from seqmoe.base.errors import UserError  # noqa: E402
from seqmoe.runtime.kernels.rerouting import DeviceCacheRouting  # noqa: E402
from tests.runtime.test_cache_routing import posted_steps_replay  # noqa: E402

L, E, K = 3, 12, 4


def _router(z: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.softmax(z.double(), -1)
    w, ids = p.topk(K, -1)
    if kind == "renormalised":
        w = w / w.sum(-1, keepdim=True)
    elif kind == "scaled":
        w = 2.5 * w
    elif kind == "other":  # not the softmax times one factor
        w = torch.linspace(0.1, 0.4, K, dtype=torch.float64).view(1, K)
    return w.float(), ids


def check_rows(rng, B: int = 3) -> None:
    """Steps of B rows: each row substituted as the host rule does it, within its own token's budget."""
    subs = 0
    for case in range(12):
        max_kl = float(rng.choice([0.01, 0.1, 1.0]))
        kind = ["renormalised", "scaled", "plain"][case % 3]
        assigned = torch.from_numpy((rng.random((L, E)) < 0.5).astype(np.uint8))
        table = torch.from_numpy(np.where(assigned.numpy() & (rng.random((L, E)) < 0.8), 0, -1).astype(np.int32))
        pool = SimpleNamespace(assigned=assigned, table=table, num_experts=E, device=torch.device("cpu"))
        device = DeviceCacheRouting(max_kl, pool, K, rows=B)
        host = CacheAwareRouting(max_kl, missing=lambda l: assigned[l].numpy() == 0,
                                 resident=lambda l: table[l].numpy() >= 0)
        for _ in range(2):
            for layer in range(L):
                z = torch.from_numpy(rng.normal(0, 2.0, (B, E))).float()
                w, ids = _router(z, kind)
                got_w, got_ids = device(layer, z, w, ids)
                want_w, want_ids = host(layer, z, w, ids)
                assert torch.equal(got_ids, want_ids), (case, layer, got_ids, want_ids)
                assert torch.allclose(got_w, want_w, rtol=1e-6, atol=1e-7), (case, layer, got_w, want_w)
        c = device.counts()
        assert c["substitutions"] == host.substitutions and abs(c["kl_total"] - host.kl_total) < 1e-9
        assert c["tokens"] == host.tokens == 2 * B
        subs += int(c["substitutions"])
    assert subs > 10, subs


def main() -> None:
    rng = np.random.default_rng(0)
    subs = refused = counted_refused = 0
    for case in range(40):
        max_kl = float(rng.choice([0.0, 0.01, 0.1, 1.0, 10.0]))
        kind = ["renormalised", "scaled", "plain", "other"][case % 4]
        assigned = torch.from_numpy((rng.random((L, E)) < 0.5).astype(np.uint8))
        table = torch.from_numpy(np.where(assigned.numpy() & (rng.random((L, E)) < 0.8), 0, -1).astype(np.int32))
        pool = SimpleNamespace(assigned=assigned, table=table, num_experts=E, device=torch.device("cpu"))
        device = DeviceCacheRouting(max_kl, pool, K)
        host = CacheAwareRouting(max_kl, missing=lambda l: assigned[l].numpy() == 0,
                                 resident=lambda l: table[l].numpy() >= 0)
        for _ in range(3):  # tokens
            for layer in range(L):
                z = torch.from_numpy(rng.normal(0, float(rng.choice([0.3, 2.0])), (1, E))).float()
                w, ids = _router(z, kind)
                got_w, got_ids = device(layer, z, w, ids)
                try:
                    want_w, want_ids = host(layer, z, w, ids)
                except UserError:  # the device leaves such a router's routing exact, and counts it
                    want_w, want_ids = w, ids
                    refused += 1
                assert torch.equal(got_ids, want_ids), (case, layer, got_ids, want_ids)
                assert torch.allclose(got_w, want_w, rtol=1e-6, atol=1e-7), (case, layer, got_w, want_w)
        c, s = device.counts(), host.stats()
        assert c["substitutions"] == host.substitutions and abs(c["kl_total"] - host.kl_total) < 1e-9, (case, c, s)
        assert c["tokens"] == host.tokens == 3 and c["activations"] == host.activations == 3 * L * K
        subs, counted_refused = subs + int(c["substitutions"]), counted_refused + int(c["refused"])
    assert subs > 30 and refused > 0 and counted_refused == refused, (subs, refused, counted_refused)
    check_rows(rng)
    posted_steps_replay(on_device=True)
    print("ok")


if __name__ == "__main__":
    main()

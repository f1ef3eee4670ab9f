"""An experts call of the eager engine: every prompt forward, and decode steps with inline control.

The routing of the call is known on the host (the router hooks fed it to the controller), so the
call reads the routed experts through the layer's `ExpertFront` (a window of slots, or rows each
from its slot or its host block) and runs the original forward on them. When the memory manager
sent some of a decode position's experts to the host CPU (`miss="cpu"` or `"auto"`), the host
executor computes those from their host rows meanwhile, and those it gave to their low-bit twins
(`twin=`) are computed from the twin rows; the partial sums are added (`_split`).
Where it sits in a decode step: docs/decode.md, "On the CPU: inline control".
"""

from __future__ import annotations

import time

import torch


def eager_forward(x, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`OffloadedExperts.forward` of a call whose routing the host knows (`x`: the experts module)."""
    t0 = time.perf_counter()
    index, bound = x.routed(args, kwargs, hidden_states)
    if (x.host is not None or x.twins is not None) and bound is None:  # empty but in a decode step
        on_host, twins = x.control.off_pool_experts(x.layer)
        if on_host or twins:
            out = _split(x, hidden_states, index, args[1], on_host, twins)
            x.done(x.layer)
            x.counts.host_s += time.perf_counter() - t0
            return out
    params, n, new_index = x.front.weights(index)
    args, kwargs = x.with_index(args, kwargs, bound, new_index)
    t1 = time.perf_counter()
    out = x.compute(params, n, hidden_states, args, kwargs)
    t2 = time.perf_counter()
    x.done(x.layer)
    x.counts.host_s += (t1 - t0) + (time.perf_counter() - t2)
    return out


def _split(x, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
           on_host: frozenset[int], twins: frozenset[int]) -> torch.Tensor:
    """One position whose routed experts `on_host` the host executor computes (`host_exec`, beside
    this module) while those in `twins` run here from their twin rows (`twins.TwinStore`) and the
    others from slots or host rows; the partial sums added."""
    flat = index.view(-1).tolist()
    host_ids = sorted({e for e in flat if e in on_host})
    twin_ids = sorted({e for e in flat if e in twins})
    here = sorted({e for e in flat if e not in on_host and e not in twins})
    future = None
    if host_ids:
        future = x.host.submit(x.host_clone, x.layout, x.pool.hosts[x.layer], host_ids, hidden_states, index, weights)
    out = None
    if here:
        out = _part(x, hidden_states, index, weights, flat, here, x.front.rows(here), x.layout)
        x.counts.gather_calls += 1
    if twin_ids:
        part = _part(x, hidden_states, index, weights, flat, twin_ids, x.twins.rows(x.layer, twin_ids), x.twins.layout)
        out = part if out is None else out + part
    if future is None:
        return out
    host_out = future.result().to(hidden_states.device)
    return host_out if out is None else out + host_out


def _part(x, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, flat: list[int],
          ids: list[int], rows: torch.Tensor, layout) -> torch.Tensor:
    """The share of experts `ids` (their packed `rows` in `layout`) in one position's output: the
    position's other routed experts become expert 0 of `rows` at weight 0 (see host_exec)."""
    pos = {e: i for i, e in enumerate(ids)}
    new_index = torch.tensor([pos.get(e, 0) for e in flat], dtype=index.dtype, device=index.device).view_as(index)
    keep = torch.tensor([e in pos for e in flat], device=weights.device).view(weights.shape[0], -1)
    return x.compute(layout.views(rows), len(ids), hidden_states, (new_index, torch.where(keep, weights, 0)), {})

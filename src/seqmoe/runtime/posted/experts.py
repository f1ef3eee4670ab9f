"""An experts call of the posted engine: a decode step that posts its routing (`control="thread"`).

The step reads no host value (capturable as a CUDA graph), so it cannot ask which experts are
resident: it gathers the B x K routed rows of its B rows on the device, each from its slot or, on a
miss, from the mapped host block (`ExpertPool.gather_posted_params`; an int8 or int4 store's rows
dequantized as they are read), and runs the original forward on them with the routed ids
renumbered into the gathered rows: static shapes (one set per batch size). An expert several rows
route is read once: the other positions point at its first row (`posted_index`, device ops). With
the host path (`host_relay`) the call first posts its inputs and waits for the control thread's
decision: the experts the host CPU computes meanwhile run here at weight 0 on zero rows, and their
sum is added after.
Where it sits in a decode step: docs/decode.md, "On CUDA: posted and captured".
"""

from __future__ import annotations

import time

import torch


def posted_forward(x, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`OffloadedExperts.forward` in a posting decode step (`x`: the experts module)."""
    relay = x.control.relay
    if relay is None or not relay.active or len(args) != 2 or kwargs:
        return _step(x, hidden_states, *args, **kwargs)
    t0 = time.perf_counter()
    index, routed_weights = args
    weights, skip, rows, twins = relay.enter(x.layer, hidden_states, index, routed_weights)
    object.__setattr__(x, "skip", skip)
    object.__setattr__(x, "host_rows", rows)
    object.__setattr__(x, "twin_part", None if twins is None else (twins, routed_weights))
    t1 = time.perf_counter()
    try:
        out = _step(x, hidden_states, index, weights)
    finally:
        object.__setattr__(x, "skip", None)
        object.__setattr__(x, "host_rows", None)
        object.__setattr__(x, "twin_part", None)
    t2 = time.perf_counter()
    out = relay.leave(x.layer, out)
    x.counts.host_s += (t1 - t0) + (time.perf_counter() - t2)
    return out


def _step(x, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    t0 = time.perf_counter()
    index, bound = x.routed(args, kwargs, hidden_states)
    posted = x.front.slot_ok
    renumbered = x.posted_index(index) if posted or x.twin_part is not None else None
    if posted:
        new_index, again = renumbered
        skip = x.skip if again is None else again if x.skip is None else again | x.skip
        params = x.pool.gather_posted_params(x.layer, index.reshape(-1), x.layout, skip, x.host_rows)
        n = index.numel()
        x.counts.posted_calls += 1
    else:  # on CUDA the step reads no slot the host chose: the slot fence covers device-side table reads only
        params, n, new_index = x.front.weights(index, host_only=x.pool.device.type == "cuda")
    args, kwargs = x.with_index(args, kwargs, bound, new_index)
    t1 = time.perf_counter()
    out = x.compute(params, n, hidden_states, args, kwargs, forward=x.posted_forward if posted else None)
    if x.twin_part is not None:  # the positions the relay gave to twins: their rows read, computed here
        out = out + _twins(x, hidden_states, index, *renumbered)
    t2 = time.perf_counter()
    x.done(x.layer)
    x.counts.host_s += (t1 - t0) + (time.perf_counter() - t2)
    return out


def _twins(x, hidden_states: torch.Tensor, index: torch.Tensor, new_index: torch.Tensor,
           again: torch.Tensor | None) -> torch.Tensor:
    """The share of the positions served by twins (`posted_index`'s renumbering of `index`): each twin
    row read once on the device, the others at weight 0 on zero rows (as the host relay's positions)."""
    take, weights = x.twin_part
    first = take if again is None else take & ~again
    params = x.twins.gather_posted_params(x.layer, index.reshape(-1), first)
    w = torch.where(take.view(weights.shape), weights, 0)
    return x.compute(params, index.numel(), hidden_states, (new_index, w), {}, forward=x.posted_forward)

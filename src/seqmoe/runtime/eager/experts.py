"""An experts call of the eager engine: every prompt forward, and decode steps with inline control.

The routing of the call is known on the host (the router hooks fed it to the controller), so the
call reads the routed experts through the layer's `ExpertFront` (a window of slots, or rows each
from its slot or its host block) and runs the original forward on them. When the memory manager
sent some of a decode position's experts to the host CPU (`miss="cpu"` or `"auto"`), the host
executor computes those from their host rows meanwhile, and those it gave to their low-bit twins
(`twin=`) are computed from the twin rows; the partial sums are added (`_split`).
A prompt's call (many positions, one call per layer) splits the same way by its own rule, once per
layer (`_prompt_host`): each missing expert costs one transfer over the link whatever its rows,
or on the host a time that grows with them (`seqmoe.costs.host_cost.PromptCosts`).
Where it sits in a decode step: docs/decode.md, "On the CPU: inline control".
"""

from __future__ import annotations

import time

import numpy as np
import torch

from seqmoe.base.errors import UserError


def eager_forward(x, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`OffloadedExperts.forward` of a call whose routing the host knows (`x`: the experts module)."""
    t0 = time.perf_counter()
    index, bound = x.routed(args, kwargs, hidden_states)
    if (x.host is not None or x.twins is not None) and bound is None:  # empty but in a decode step
        on_host, twins = x.control.off_pool_experts(x.layer)
        emulated = None
        if not (on_host or twins) and x.host is not None and index.shape[0] > 1:
            on_host, emulated = _prompt_host(x, index)
        if on_host or twins:
            out = _split(x, hidden_states, index, args[1], on_host, twins, emulated)
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


def _prompt_host(x, index: torch.Tensor) -> tuple[frozenset[int], float | None]:
    """(the experts of a prompt's call ([N, K] routed `index`) the host CPU computes, their emulated
    host time or None): of the routed experts not in a slot, with miss cpu (or a system computing on
    the host) all, with auto the fewest-rows share `PromptCosts.on_host` gives it; the others are
    read over the link. None for a decode step (the manager chose its paths) or without a cost model."""
    costs, fwd, manager = x.host.prompt, x.control._forward, x.control.state
    if costs is None or fwd is None or len(fwd[2][0]) < 2 or not (manager.miss.may_use_host_cpu or manager.host_only):
        return frozenset(), None
    rows = np.bincount(index.reshape(-1).cpu().numpy(), minlength=x.num_experts)
    if len(rows) > x.num_experts:
        raise UserError(f"expert index {len(rows) - 1} >= {x.num_experts}: expert parallelism is not supported")
    missing = np.flatnonzero((rows > 0) & (x.pool.table_host[x.layer] < 0))
    missing = missing[np.argsort(rows[missing], kind="stable")]  # fewest rows first
    j = len(missing) if manager.miss.always_host_cpu or manager.host_only else costs.on_host(rows[missing])
    c = x.counts
    c.prompt_calls, c.prompt_host, c.prompt_link = c.prompt_calls + 1, c.prompt_host + j, c.prompt_link + len(missing) - j
    host = missing[:j]
    return frozenset(host.tolist()), float(costs.host_s(rows[host]).sum()) if x.host.emulated_s else None


def _split(x, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
           on_host: frozenset[int], twins: frozenset[int], emulated: float | None = None) -> torch.Tensor:
    """One position whose routed experts `on_host` the host executor computes (`host_exec`, beside
    this module) while those in `twins` run here from their twin rows (`twins.TwinStore`) and the
    others from slots or host rows; the partial sums added. `emulated`: the host part's emulated time
    (a prompt's, `_prompt_host`; else the executor's per expert)."""
    if index.shape[0] > 1:  # many rows (a prompt, a batch): numpy over the routed ids
        flat = index.reshape(-1).cpu().numpy()
        used = np.unique(flat).tolist()
    else:
        flat = index.view(-1).tolist()
        used = sorted(set(flat))
    host_ids = [e for e in used if e in on_host]
    twin_ids = [e for e in used if e in twins]
    here = [e for e in used if e not in on_host and e not in twins]
    future = None
    if host_ids:
        future = x.host.submit(x.host_clone, x.layout, x.pool.hosts[x.layer], host_ids, hidden_states, index, weights,
                               emulated)
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


def _part(x, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, flat,
          ids: list[int], rows: torch.Tensor, layout) -> torch.Tensor:
    """The share of experts `ids` (their packed `rows` in `layout`) in the output: each row's other
    routed experts become expert 0 of `rows` at weight 0 (see host_exec). `flat`: the routed ids, a
    list (one row) or a numpy array (many)."""
    if isinstance(flat, np.ndarray):
        lut = np.full(x.num_experts, -1, dtype=np.int64)
        lut[ids] = np.arange(len(ids))
        sel = lut[flat]
        new_index = torch.from_numpy(np.maximum(sel, 0)).to(index.device, index.dtype).view_as(index)
        keep = torch.from_numpy(sel >= 0).to(weights.device).view(weights.shape[0], -1)
    else:
        pos = {e: i for i, e in enumerate(ids)}
        new_index = torch.tensor([pos.get(e, 0) for e in flat], dtype=index.dtype, device=index.device).view_as(index)
        keep = torch.tensor([e in pos for e in flat], device=weights.device).view(weights.shape[0], -1)
    return x.compute(layout.views(rows), len(ids), hidden_states, (new_index, torch.where(keep, weights, 0)), {})

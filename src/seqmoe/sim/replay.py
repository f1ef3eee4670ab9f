"""Replay a routing trace as batch-1 (or batched) decode against a cost model (docs/DESIGN.md's protocol).

    counts = simulate(trace, system, model=..., hardware=..., capacity=C, start=placement)

The decisions are the memory manager's (`seqmoe.brain.manager`), driven by the same `Driver` the
runtime's control plane uses; `sim` never imports `runtime`.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from seqmoe.brain.manager.disk_clock import DiskClock
from seqmoe.brain.manager.host_tier import HostTier
from seqmoe.brain.manager.host_tier import host_policy as default_host_policy
from seqmoe.brain.rerouting import CacheAwareRouting
from seqmoe.base.errors import UserError
from seqmoe.brain.manager import Driver, System, build_manager
from seqmoe.brain.manager.counts import SimCounts, spans_total
from seqmoe.costs.profiles import HardwareProfile, ModelProfile, disk_read_s
from seqmoe.sim.lockstep import Lockstep
from seqmoe.trace.schema import RoutingTrace, check_dims


def simulate(trace: RoutingTrace, system: System, *, model: ModelProfile, hardware: HardwareProfile,
             capacity: int, start, progress: bool = False, compiled: bool = True,
             max_kl: float | None = None, window_tokens: int | None = None, plan: Lockstep | None = None,
             pools: dict | None = None, host_rows: int | None = None, host_policy: str | None = None,
             scored: np.ndarray | None = None, span: range | None = None) -> SimCounts:
    """Replay `trace` as batch-1 decode (or batched, by `plan`) with `system` managing `capacity` slots.

    Args:
        trace: the routing to replay (requests back to back).
        system: eviction policy, predictor, scheduler; reset here from `start`.
        model, hardware: the cost model.
        capacity: C, slots in the pool.
        start: the start placement, at most C uids (`seqmoe.brain.manager.start_placement`).
        progress: show a progress bar.
        compiled: let the compiled manager run the systems it can (`seqmoe.brain.manager.build_manager`);
            False: the reference Python state machine (the same decisions, slower).
        max_kl: replay cache-aware routing with this budget, nats per token (`seqmoe.brain.rerouting`;
            the trace must hold `router_logits`); None: the recorded routing.
        window_tokens: also count each window of this many tokens (`SimCounts.windows`; batched: from the
            first step boundary at or after each multiple of it).
        plan: decode the requests B at a time in lockstep (`seqmoe.sim.lockstep`); None: batch 1.
        pools: token offsets (its keys) at whose start the replay records the readable pool ([L * E]
            bool: resident, copy done) into it, before the token starts (`seqmoe.sim.prefill`; batched:
            before the step where that request starts).
        host_rows: H, a host cache of H expert rows in front of the disk (`seqmoe.brain.manager.disk_clock`; the
            hardware profile needs a disk; twins, if any, beside it in host memory), starting with `start`'s rows; None:
            every expert in host memory.
        host_policy: the host cache's policy ("lru" or "forecast"); None: `seqmoe.brain.manager.host_tier.host_policy`.
        scored: [T] bool, the tokens the counts are of (a protocol's warm-up tokens are replayed, not
            scored: `seqmoe.sim.protocol`); None: every token. Batch 1 only.
        span: replay only these tokens (whole requests), numbered as in `trace`, so that a system reading
            the trace's future (an oracle) finds it at the right place; None: every token. Batch 1 only.

    Returns:
        Counts and times of the replay (see `seqmoe.brain.manager.summarize` for the metrics).
    """
    check_dims("trace", trace, model)
    if max_kl is not None and (trace.router_logits is None or trace.gate_weights is None):
        raise UserError("cache-aware routing replays router logits and gate weights, and this trace lacks them: "
                        "collect it with `seqmoe trace collect --router-logits`")
    gates = trace.gate_weights if system.twin is not None else None
    if gates is None and system.twin is not None:
        raise UserError("the twin miss path picks misses by their gate weights, and this trace lacks them: replay a "
                        "trace that holds gate_weights (`seqmoe trace collect`, or a Mixtral JSONL trace)")
    disk = None if host_rows is None else _disk(system, model, hardware, host_rows, host_policy, start, plan)
    manager = build_manager(system, model=model, hardware=hardware, capacity=capacity, start=start, compiled=compiled,
                            observer=None if disk is None else disk.observer(),
                            on_forecast=None if disk is None else disk.note_forecast)
    driver = Driver(manager, disk=disk)
    if disk is not None:
        disk.attach(manager)
    if (scored is not None or span is not None) and plan is not None and plan.batch > 1:
        raise ValueError("scored tokens and spans are a batch-1 replay's: a batched step serves several requests")
    span = range(trace.num_tokens) if span is None else span
    return _replay(trace, system, driver, progress, max_kl, window_tokens, plan, pools, gates, scored, span)


def _disk(system, model, hardware, rows, policy, start, plan) -> DiskClock:
    """The disk tier's clock for `simulate`: H = `rows` host rows holding `start`'s rows at first."""
    tier = HostTier(rows, model.num_layers, model.num_experts, policy=policy or default_host_policy(system),
                    read_s=disk_read_s(model, hardware), start=start)
    return DiskClock(tier, model=model, hardware=hardware)


def _replay(trace, system, driver, progress, max_kl, window_tokens, plan, pools, gates, scored, span) -> SimCounts:
    """`simulate`'s replay on `driver`."""
    routing = None if max_kl is None else _replayed_routing(driver, max_kl)
    if plan is not None and plan.batch > 1:
        return _simulate_batched(trace, driver, plan, progress, system.name, window_tokens, routing, gates, pools)
    L, K = trace.num_layers, trace.top_k
    flat = trace.uids().reshape(-1, K).astype(np.int64)  # [T * L, K]
    if not driver.manager.takes_arrays:
        flat = flat.tolist()
    ids = trace.expert_ids
    tokens = trace.token_ids.tolist() if trace.token_ids is not None else None
    starts = set(trace.request_offsets[:-1].tolist())
    bar = tqdm(total=len(span), disable=not progress, unit="tok", desc=system.name, mininterval=0.5, leave=False)
    windows, mark, spans, opened = [], None, [], None
    driver.first = span.start  # positions numbered as in the trace
    for t in span:
        if scored is not None and bool(scored[t]) != (opened is not None):
            opened = _toggle_span(driver, spans, opened)
        if window_tokens and t % window_tokens == 0:
            mark = _close_window(driver, windows, mark)
        if pools is not None and t in pools:
            pools[t] = np.array(driver.manager.readable_mask(driver.clock), dtype=bool)
        driver.token_start(tokens[t] if tokens is not None else None, t in starts)
        row = ids[t]
        for l in range(L):
            step = t * L + l
            if routing is None:
                driver.reveal(l, row[l], flat[step], None if gates is None else gates[t, l])
            else:
                driver.reveal(l, *_routed(routing, trace, t, l))
            driver.layer_end(l)
        if t % 256 == 255:
            bar.update(256)
    bar.close()
    if window_tokens:
        _close_window(driver, windows, mark)
    counts = driver.finish()
    if scored is not None:
        if opened is not None:
            spans.append((opened, counts))
        counts = spans_total(spans or [(counts, counts)])
    counts.routing = None if routing is None else routing.stats()
    counts.windows = windows or None
    return counts


def _toggle_span(driver: Driver, spans: list, opened):
    """Open a scored span (return the counts at its start) or close `opened` into `spans` (return None)."""
    if opened is None:
        return driver.counts()
    spans.append((opened, driver.counts()))
    return None


def _simulate_batched(trace: RoutingTrace, driver: Driver, plan: Lockstep, progress: bool, name: str,
                      window_tokens: int | None = None, routing: CacheAwareRouting | None = None,
                      gates: np.ndarray | None = None, pools: dict | None = None) -> SimCounts:
    """`simulate` over the steps of `plan`: each lane's token, every layer's [B, K] routing at once (after
    the cache-aware `routing`, each row within its own token's budget); a window opens at the first
    step boundary at or after each multiple of `window_tokens` tokens decoded."""
    ids = trace.expert_ids
    tokens = trace.token_ids.tolist() if trace.token_ids is not None else None
    predictor = driver.manager.system.predictor
    source = None if predictor is None else predictor.replay_tokens
    bar = tqdm(total=plan.num_steps, disable=not progress, unit="step", desc=name, mininterval=0.5, leave=False)
    windows, mark, edge = [], None, 0
    for s in range(plan.num_steps):
        if window_tokens and driver.rows >= edge:
            mark = _close_window(driver, windows, mark)
            edge = (driver.rows // window_tokens + 1) * window_tokens
        lanes = np.flatnonzero(plan.rows[s] >= 0)
        rows = plan.rows[s, lanes]
        if pools is not None:  # a request starting here is priced from the pool at the step's start
            for t in rows[plan.new[s, lanes]].tolist():
                if t in pools:
                    pools[t] = np.array(driver.manager.readable_mask(driver.clock), dtype=bool)
        if source is not None:  # what each lane reads of the trace by token is its own token's
            source.tokens = rows.tolist()
        driver.step_start([tokens[t] for t in rows] if tokens is not None else [None] * len(rows),
                          plan.new[s, lanes].tolist(), lanes.tolist())
        step_ids = ids[rows]  # [B, L, K]
        for l in range(trace.num_layers):
            routed, weights = step_ids[:, l], None if gates is None else gates[rows, l]
            if routing is not None:
                got = routing.substitute(l, lambda: trace.router_logits[rows, l].astype(np.float64),
                                         lambda: trace.gate_weights[rows, l].astype(np.float64), routed)
                if got is not None:
                    routed, weights = got[1].astype(routed.dtype), None if gates is None else got[0]
            driver.reveal(l, routed, weights=weights)
            driver.layer_end(l)
        if s % 64 == 63:
            bar.update(64)
    bar.close()
    if source is not None:
        source.tokens = None
    if window_tokens:
        _close_window(driver, windows, mark)
    counts = driver.finish()
    counts.windows = windows or None
    counts.routing = None if routing is None else routing.stats()
    return counts


def _close_window(driver: Driver, windows: list[dict], mark):
    """Append the window since `mark` (the counts at its start) to `windows`; the counts now."""
    now = driver.counts()
    if mark is not None and now.num_tokens > mark.num_tokens:
        hits = (now.ready + now.late) - (mark.ready + mark.late)
        n = hits + now.misses - mark.misses
        windows.append({"first_token": mark.num_tokens, "tokens": now.num_tokens - mark.num_tokens,
                        "hit_rate": hits / n if n else 0.0, "time_s": now.time_s - mark.time_s,
                        "copies": now.copies - mark.copies})
    return now


def _replayed_routing(driver: Driver, max_kl: float) -> CacheAwareRouting:
    """The cache-aware rule against the replay's pool, as the runtime applies it against its slots
    (the rule asks for a layer's missing experts before its readable ones)."""
    state = {}

    def missing(layer: int) -> np.ndarray:
        state["missing"], state["readable"] = driver.pool_at_reveal(layer)
        return state["missing"]

    return CacheAwareRouting(max_kl, missing=missing, resident=lambda layer: state["readable"])


def _routed(routing: CacheAwareRouting, trace: RoutingTrace, t: int, l: int) -> tuple:
    """([K] expert ids, None, [K] gate weights) of (token t, layer l) after the rule (`Driver.reveal`'s arguments)."""
    ids = trace.expert_ids[t, l][None]
    got = routing.substitute(l, lambda: trace.router_logits[t, l][None].astype(np.float64),
                             lambda: trace.gate_weights[t, l][None].astype(np.float64), ids)
    if got is None:
        return ids[0], None, trace.gate_weights[t, l]
    return got[1][0].astype(ids.dtype), None, got[0][0]

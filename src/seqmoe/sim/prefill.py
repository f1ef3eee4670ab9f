"""The protocol's prefill extension: time to first token (TTFT) of a prompt of P positions.

A prompt is ONE forward of its P positions through the L MoE layers. At each layer the router
reveals the union of the positions' experts, each with its rows (the positions routed to it); every
distinct expert is read once for all its rows: computed from its slot, moved over the link once (a
copy or an in-place read, `c`), or computed on the host CPU, whose time grows with the rows. A
prompt is compute-bound where a decode token is memory-bound, so each device part takes the larger
of its bytes over the memory rate and its FLOPs over the FLOP rate. The cost model, the same for
every system (`PrefillCosts`; with `rate = hbm_efficiency x hbm_bytes_per_s`, `F =
compute_efficiency x device_flops_per_s`, `f = 2 x expert_params` FLOPs per row of an expert):

    outside the MoE layers   t0_P = max(token_bytes / rate, (P x token_flops + head_flops) / F)
    non-expert, per layer    n_P  = max(layer_bytes / rate, P x layer_flops / F)
    experts D on the device  x(D) = max(|D| x expert_bytes / rate, rows(D) x f / F)
    one host expert, m rows  h(m) = alpha + max(expert_bytes / host read rate, m x f / host_flops_per_s)
    layer l                  n_P + max(c x |link_l| + x(resident_l + link_l), sum of h over host_l)
    TTFT                     t0_P + sum over layers

The layer's transfers run back to back from its reveal and its device experts start when the last
has finished (as a decode layer's do); the host computes its experts one after another from the
reveal. Nothing is moved before a reveal: a system's forecaster forecasts decode positions, not a
prompt's. Which missing experts go where: `copy` and `in-place` move them all, `cpu` computes them
all on the host, `auto` gives the host the j with fewest rows and moves the rest, j chosen so that
the layer ends earliest (ties: fewer on the host). A copy and an in-place read cost the same `c`;
the pool as it stood at the prompt's start serves the whole forward (no expert it holds is evicted
before its layer computes). Full load: every expert resident. The bound (`prefill_bound`) holds for
any schedule from the same pool, prefetching or not: see its docstring.

    costs = prefill_costs(model, hardware)
    rows = prompt_rows(trace.expert_ids[s:s + P], E)           # [L, E] positions routed to each expert
    prefill_time(rows, resident, costs, "auto").time_s            # resident: [L, E] bool at the start
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.brain.manager.miss_paths import miss_rule
from seqmoe.costs.host_cost import has_host_path, host_expert_bytes_per_s, host_flops_per_s
from seqmoe.costs.profiles import HardwareProfile, ModelProfile, copy_time_s


@dataclass(frozen=True)
class PrefillCosts:
    """The rates of the prefill cost model for one model on one machine (the module docstring)."""

    rate: float  # device memory bytes/s reached
    flops: float  # device FLOP/s reached
    copy_s: float  # c: one expert over the link
    expert_bytes: int
    expert_flops: float  # f: FLOPs of one expert for one row
    layer_bytes: int
    layer_flops: int
    token_bytes: int
    token_flops: int
    head_flops: int
    host_alpha_s: float | None = None  # the host path's round trip; None: no host CPU path
    host_read_s: float = 0.0  # one expert's bytes over the host's read rate
    host_row_s: float = 0.0  # f over the host's FLOP rate

    @property
    def has_host(self) -> bool:
        return self.host_alpha_s is not None

    def host_s(self, rows: np.ndarray) -> np.ndarray:
        """[N] h(m): seconds the host takes for each of N experts of `rows` ([N] int) rows."""
        return self.host_alpha_s + np.maximum(self.host_read_s, np.asarray(rows) * self.host_row_s)

    def device_s(self, experts, rows):
        """x(D): seconds the device takes for `experts` distinct experts computing `rows` rows in all."""
        return np.maximum(np.asarray(experts) * self.expert_bytes / self.rate,
                          np.asarray(rows) * self.expert_flops / self.flops)

    def outside_s(self, positions: int) -> float:
        """t0_P: a forward's time outside the MoE layers."""
        return max(self.token_bytes / self.rate, (positions * self.token_flops + self.head_flops) / self.flops)

    def non_expert_s(self, positions: int) -> float:
        """n_P: one MoE layer's time besides its routed experts."""
        return max(self.layer_bytes / self.rate, positions * self.layer_flops / self.flops)


def prefill_costs(model: ModelProfile, hw: HardwareProfile) -> PrefillCosts:
    """The prefill rates of `model` (at its stored precision) on `hw`; a UserError when `hw` lacks a FLOP rate."""
    if hw.device_flops_per_s is None:
        raise UserError(f"hardware profile '{hw.name}' gives no device_flops_per_s, so a prompt's forward cannot be "
                        "priced: add device_flops_per_s (and compute_efficiency) to the profile")
    f = 2.0 * (model.expert_params or model.expert_bytes // 2)
    host = {}
    if has_host_path(hw):  # the runtime's rule for a host without a FLOP rate (`host_flops_per_s`)
        host = dict(host_alpha_s=hw.copy_overhead_s, host_read_s=model.expert_bytes / host_expert_bytes_per_s(hw),
                    host_row_s=f / host_flops_per_s(hw))
    return PrefillCosts(rate=hw.hbm_efficiency * hw.hbm_bytes_per_s, flops=hw.compute_efficiency * hw.device_flops_per_s,
                        copy_s=copy_time_s(model, hw), expert_bytes=model.expert_bytes, expert_flops=f,
                        layer_bytes=model.layer_bytes, layer_flops=model.layer_flops, token_bytes=model.token_bytes,
                        token_flops=model.token_flops, head_flops=model.head_flops, **host)


@dataclass(frozen=True)
class PrefillTime:
    """One prompt's forward: its time and what moved."""

    time_s: float  # TTFT
    transfers: int  # experts moved over the link (copies or in-place reads)
    host_experts: int  # experts computed on the host CPU


def check_prompt_lengths(lengths, num_tokens: int) -> tuple[int, ...]:
    """`lengths` as distinct positive ints no longer than the trace; a UserError otherwise."""
    got = []
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise UserError(f"a prompt length is a positive number of positions, got {n!r}")
        if n > num_tokens:
            raise UserError(f"a prompt of {n} positions is longer than the replayed trace ({num_tokens} tokens): "
                            "give shorter --prompt-lengths or a longer trace")
        if int(n) not in got:
            got.append(int(n))
    return tuple(got)


def prompt_starts(request_offsets: np.ndarray, num_tokens: int, positions: int) -> np.ndarray:
    """[N] token offsets of the prompts of `positions` positions: every request start s with s + P <= T
    (the window runs into the next requests when its own is shorter: traces hold few long prompts)."""
    starts = np.asarray(request_offsets[:-1], dtype=np.int64)
    starts = starts[starts + positions <= num_tokens]
    if len(starts) == 0:
        raise UserError(f"no request starts {positions} tokens or more before the trace's end ({num_tokens} tokens): "
                        "give shorter --prompt-lengths")
    return starts


def prompt_rows(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] int64: how many of the prompt's positions each expert serves, from `ids` [P, L, K] expert ids."""
    P, L, K = ids.shape
    flat = ids.transpose(1, 0, 2).reshape(L, P * K).astype(np.int64) + np.arange(L)[:, None] * num_experts
    return np.bincount(flat.ravel(), minlength=L * num_experts).reshape(L, num_experts)


def prefill_time(rows: np.ndarray, resident: np.ndarray, costs: PrefillCosts, miss: str, positions: int) -> PrefillTime:
    """The forward of a prompt of `positions` positions whose routing is `rows` ([L, E] positions per
    expert) from a pool holding `resident` ([L, E] bool), its missing experts served by `miss`."""
    rule = miss_rule(miss)
    if rule.always_host_cpu and not costs.has_host:
        raise UserError("the cpu miss path needs a host CPU in the hardware profile (host_cores, host_memory_bytes_per_s)")
    total, transfers, on_host = 0.0, 0, 0
    for l in range(rows.shape[0]):
        used = rows[l] > 0
        res = used & resident[l]
        m = np.sort(rows[l][used & ~resident[l]])  # the missing experts' rows, fewest first
        M, dev_n, dev_rows = len(m), int(res.sum()), int(rows[l][res].sum())
        if rule.always_host_cpu:
            j = M
        elif rule.path is None and costs.has_host and M:  # chosen per miss
            host_cum = np.concatenate(([0.0], np.cumsum(costs.host_s(m))))  # [M + 1] host time of the j fewest
            moved_rows = np.concatenate(([0], np.cumsum(m[::-1])))[::-1]  # [M + 1] rows of the other M - j
            moved = np.arange(M, -1, -1)
            end = np.maximum(costs.copy_s * moved + costs.device_s(dev_n + moved, dev_rows + moved_rows), host_cum)
            j = int(np.argmin(end))  # the first minimum: fewest on the host
        else:
            j = 0
        device = float(costs.device_s(dev_n + M - j, dev_rows + int(m[j:].sum())))
        host_s = float(costs.host_s(m[:j]).sum()) if j else 0.0
        total += max(costs.copy_s * (M - j) + device, host_s)
        transfers, on_host = transfers + M - j, on_host + j
    total += costs.outside_s(positions) + rows.shape[0] * costs.non_expert_s(positions)
    return PrefillTime(total, transfers, on_host)


def full_load_time(rows: np.ndarray, costs: PrefillCosts, positions: int) -> float:
    """TTFT with every expert resident."""
    return prefill_time(rows, np.ones(rows.shape, dtype=bool), costs, "copy", positions).time_s


def prefill_bound(rows: np.ndarray, resident: np.ndarray, costs: PrefillCosts, positions: int) -> float:
    """A lower bound on TTFT for any schedule from the pool `resident`, prefetching or not, with any
    split of its N missing experts between the link and the host:

        min over j = 0..N of max(F_res, c x (N - j), H_j)

    F_res: the forward with only the resident used experts on the device (the device computes at
    least those; x(D) grows with D); c x (N - j): the link moves the experts the host does not
    compute, one at a time; H_j: the host's j cheapest experts (those of fewest rows), one after
    another. The three may overlap at best. Without a host: max(F_res, c x N)."""
    used = rows > 0
    res = used & resident
    f_res = (costs.outside_s(positions) + rows.shape[0] * costs.non_expert_s(positions)
             + float(costs.device_s(res.sum(axis=1), np.where(res, rows, 0).sum(axis=1)).sum()))
    m = np.sort(rows[used & ~resident])
    N = len(m)
    if not costs.has_host:
        return max(f_res, costs.copy_s * N)
    host_cum = np.concatenate(([0.0], np.cumsum(costs.host_s(m))))
    return float(np.min(np.maximum(np.maximum(f_res, costs.copy_s * np.arange(N, -1, -1)), host_cum)))


def prefill_fields(ids: np.ndarray, request_offsets: np.ndarray, pools: dict, lengths, costs: PrefillCosts,
                   miss: str) -> dict:
    """The row's `prefill` field: per prompt length P, TTFT averaged over the prompts of P positions
    that start at each request (`prompt_starts`) from the pool the replay held there (`pools`:
    token offset -> [L * E] bool), next to full load, the bound and a cold (empty) pool.

    Args:
        ids: [T, L, K] the replayed routing; request_offsets: [R + 1] its requests.
        pools: the readable pool at each request start (`simulate(pools=...)`).
        lengths: prompt lengths P; miss: the system's miss path.
    """
    T, L, _ = ids.shape
    E = next(iter(pools.values())).shape[0] // L
    out = {}
    for P in lengths:
        got = {k: [] for k in ("ttft_s", "full_load_ttft_s", "bound_ttft_s", "cold_ttft_s", "transfers",
                               "host_experts", "distinct_experts", "resident_share")}
        for s in prompt_starts(request_offsets, T, P):
            rows = prompt_rows(ids[s:s + P], E)
            resident = np.asarray(pools[int(s)], dtype=bool).reshape(L, E)
            t = prefill_time(rows, resident, costs, miss, P)
            used = rows > 0
            got["ttft_s"].append(t.time_s)
            got["transfers"].append(t.transfers)
            got["host_experts"].append(t.host_experts)
            got["full_load_ttft_s"].append(full_load_time(rows, costs, P))
            got["bound_ttft_s"].append(prefill_bound(rows, resident, costs, P))
            got["cold_ttft_s"].append(prefill_time(rows, np.zeros_like(resident), costs, miss, P).time_s)
            got["distinct_experts"].append(int(used.sum()))
            got["resident_share"].append(float((used & resident).sum() / used.sum()))
        row = {"prompts": len(got["ttft_s"])}
        row.update({k: float(np.mean(v)) for k, v in got.items()})
        row["ttft_p90_s"] = float(np.percentile(got["ttft_s"], 90))
        row["vs_full_load"] = row["ttft_s"] / row["full_load_ttft_s"]
        out[str(P)] = row
    return out

"""What one routed expert costs on the host CPU (the CPU miss path of docs/DESIGN.md's protocol).

At batch 1 an expert is one pass over its weights, so its time is its bytes over the rate at which
the host's matmul reads them: the lesser of what the cores can compute and what the memory
delivers. Both rates come from a measurement on our 2-core development VM (AMD EPYC Zen 4, torch
2.13's CPU bf16 matmul; `benchmarks/host_expert.py`, docs/LOG.md 2026-12-02), scaled to a
profile's cited host by its core count and its DRAM bandwidth:

    rate = min(host_cores x PER_CORE, MATMUL_SHARE x SUSTAINED_SHARE x host_memory_bytes_per_s)
    host_expert_time_s = copy_overhead_s + expert_bytes / rate

The overhead is one small round trip over the link (the hidden state down, the expert's output
back: kilobytes, so only the fixed cost of a transfer counts).

A prompt sends an expert many rows at once: its host time then grows with them (`PromptCosts`,
the simulator's h(m) of `seqmoe.sim.prefill`), while moving it over the link costs one copy
whatever its rows:

    h(m) = copy_overhead_s + max(expert_bytes / rate, m x 2 x expert_params / host FLOP rate)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqmoe.costs.profiles import HardwareProfile, ModelProfile, copy_time_s

HOST_CORE_FLOPS_PER_S = 200e9
"""bf16 FLOP/s one core sustains in expert matmuls of many rows (the presets' rate: 190 measured on one
thread of our VM, `seqmoe.costs.presets`); a host without `host_flops_per_s` gets its cores x this."""
PER_CORE_BYTES_PER_S = 13.0e9
"""Weight bytes per second one core's bf16 expert matmul reads: 26.1 GB/s measured with 2 threads."""
MATMUL_SHARE = 0.82
"""The expert matmul's read rate over the same machine's STREAM-style copy bandwidth (26.1 / 31.8 GB/s)."""
SUSTAINED_SHARE = 0.75
"""STREAM's sustained bandwidth over the DDR wire rate: 74-78 % in TI's published STREAM tables
(SPRAD45A, SPRACV1B); applied to a profile's peak DRAM bandwidth."""


def has_host_path(hw: HardwareProfile) -> bool:
    """The profile describes its host CPU (`host_cores`, `host_memory_bytes_per_s`)."""
    return hw.host_cores is not None


def host_expert_bytes_per_s(hw: HardwareProfile) -> float:
    """Weight bytes per second the host reads while computing experts (see the module docstring)."""
    if not has_host_path(hw):
        raise ValueError(f"hardware profile {hw.name!r} has no host CPU fields")
    return min(hw.host_cores * PER_CORE_BYTES_PER_S, MATMUL_SHARE * SUSTAINED_SHARE * hw.host_memory_bytes_per_s)


def host_expert_time_s(model: ModelProfile, hw: HardwareProfile) -> float | None:
    """Seconds the host CPU takes for one routed expert at batch 1; None without a host in the profile."""
    if not has_host_path(hw):
        return None
    return hw.copy_overhead_s + model.expert_bytes / host_expert_bytes_per_s(hw)


def host_fields(expert_bytes: int, expert_s: float, overhead_s: float, flops_per_s: float | None = None) -> dict:
    """The host fields of a profile under which `host_expert_time_s` is `expert_s` (a measured host:
    memory-bound, with cores to spare), and its FLOP rate on many rows when measured (`flops_per_s`)."""
    rate = expert_bytes / max(expert_s - overhead_s, 1e-12)
    fields = dict(host_memory_bytes_per_s=rate / (MATMUL_SHARE * SUSTAINED_SHARE),
                  host_cores=int(rate // PER_CORE_BYTES_PER_S) + 1)
    return fields if flops_per_s is None else {**fields, "host_flops_per_s": flops_per_s}


def host_flops_per_s(hw: HardwareProfile) -> float:
    """FLOP/s of the host's expert matmuls on many rows: the profile's, else its cores x `HOST_CORE_FLOPS_PER_S`."""
    if not has_host_path(hw):
        raise ValueError(f"hardware profile {hw.name!r} has no host CPU fields")
    return hw.host_flops_per_s if hw.host_flops_per_s is not None else hw.host_cores * HOST_CORE_FLOPS_PER_S


@dataclass(frozen=True)
class PromptCosts:
    """What a prompt's missing expert costs each way (module docstring): `link_s` over the link (a copy
    or an in-place read, any rows), `host_s(m)` on the host CPU for m rows."""

    link_s: float
    alpha_s: float
    read_s: float
    row_s: float

    def host_s(self, rows: np.ndarray) -> np.ndarray:
        """[N] h(m) of N experts of `rows` ([N] ints) rows."""
        return self.alpha_s + np.maximum(self.read_s, np.asarray(rows, dtype=np.float64) * self.row_s)

    def on_host(self, rows: np.ndarray) -> int:
        """How many of the missing experts of `rows` ([M] ints, fewest first) the host computes: the j
        fewest, j such that the later of the link's M - j transfers (one after another) and the host's j
        experts (one after another, meanwhile) ends first; ties: fewer on the host, so a lone expert
        goes to the host only when h(m) < link_s."""
        host_end = np.concatenate(([0.0], np.cumsum(self.host_s(rows))))
        link_end = self.link_s * np.arange(len(rows), -1, -1, dtype=np.float64)
        return int(np.argmin(np.maximum(link_end, host_end)))


def prompt_costs(model: ModelProfile, hw: HardwareProfile) -> PromptCosts | None:
    """The `PromptCosts` of `model` on `hw`; None without a host CPU in the profile."""
    if not has_host_path(hw):
        return None
    return PromptCosts(link_s=copy_time_s(model, hw), alpha_s=hw.copy_overhead_s,
                       read_s=model.expert_bytes / host_expert_bytes_per_s(hw),
                       row_s=2.0 * (model.expert_params or model.expert_bytes // 2) / host_flops_per_s(hw))

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
"""

from __future__ import annotations

from seqmoe.profiles import HardwareProfile, ModelProfile

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


def host_fields(expert_bytes: int, expert_s: float, overhead_s: float) -> dict:
    """The host fields of a profile under which `host_expert_time_s` is `expert_s` (a measured host:
    memory-bound, with cores to spare)."""
    rate = expert_bytes / max(expert_s - overhead_s, 1e-12)
    return dict(host_memory_bytes_per_s=rate / (MATMUL_SHARE * SUSTAINED_SHARE),
                host_cores=int(rate // PER_CORE_BYTES_PER_S) + 1)

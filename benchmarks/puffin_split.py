"""The real-routing workloads the benchmarks share: DeepSeek-V2-Lite's Puffin routing trace of
../shared, its last 200 prompts (file order) replayed, the other 1,599 training; Mixtral-8x7B's
speculative-moe routing (4 prompts), the last 2 replayed.

    add_shared_flag(parser); train, test = puffin_split(args.shared)   # None when ../shared is absent
    train, test = mixtral_split(args.shared)                            # likewise
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from seqmoe.trace.io import load_trace

TEST_PROMPTS = 200


def add_shared_flag(p) -> None:
    default = os.environ.get("SEQMOE_SHARED", str(Path(__file__).resolve().parents[2] / "shared"))
    p.add_argument("--shared", default=default, help="the shared folder holding data/traces (default: ../shared)")


def puffin_split(shared: str | Path):
    """(train, test) of the shared Puffin trace, or None (with a note on stderr) when it is absent."""
    return _split(Path(shared) / "data/traces/deepseek-v2-lite-puffin/puffin", TEST_PROMPTS, "DeepSeek-V2-Lite")


def mixtral_split(shared: str | Path):
    """(train, test) of the shared Mixtral-8x7B routing, or None (with a note on stderr) when it is absent."""
    return _split(Path(shared) / "data/traces/mixtral8x7b-speculative-moe/routing_data_collected", 2, "Mixtral-8x7B")


def _split(folder: Path, test_requests: int, name: str):
    """(all but the last `test_requests` requests, those) of the trace at `folder`, or None when absent."""
    if not folder.is_dir():
        print(f"shared traces not found at {folder}; {name} skipped", file=sys.stderr)
        return None
    trace = load_trace(folder)
    R = trace.num_requests
    return trace.select_requests(np.arange(R - test_requests)), trace.select_requests(np.arange(R - test_requests, R))


def deepseek_or_tiny(shared: str | Path, tiny: bool):
    """((train, test), model profile, trace name): DeepSeek-V2-Lite's Puffin split when `shared` holds
    it and `tiny` is off, else seqmoe-tiny's shipped routing."""
    split = None if tiny else puffin_split(shared)
    if split is None:
        data = Path(__file__).resolve().parents[1] / "src/seqmoe/data"
        traces = tuple(load_trace(data / f"seqmoe-tiny-{part}.safetensors") for part in ("train", "test"))
        return traces, "seqmoe-tiny", "seqmoe-tiny"
    return split, "deepseek-v2-lite", "DeepSeek-V2-Lite"

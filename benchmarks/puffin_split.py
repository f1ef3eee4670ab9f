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
    puffin = Path(shared) / "data/traces/deepseek-v2-lite-puffin/puffin"
    if not puffin.is_dir():
        print(f"shared traces not found at {puffin}; DeepSeek-V2-Lite skipped", file=sys.stderr)
        return None
    trace = load_trace(puffin)
    R = trace.num_requests
    return trace.select_requests(np.arange(R - TEST_PROMPTS)), trace.select_requests(np.arange(R - TEST_PROMPTS, R))


def mixtral_split(shared: str | Path):
    """(train, test) of the shared Mixtral-8x7B routing, or None (with a note on stderr) when it is absent."""
    folder = Path(shared) / "data/traces/mixtral8x7b-speculative-moe/routing_data_collected"
    if not folder.is_dir():
        print(f"shared traces not found at {folder}; Mixtral-8x7B skipped", file=sys.stderr)
        return None
    trace = load_trace(folder)
    R = trace.num_requests
    return trace.select_requests(np.arange(R - 2)), trace.select_requests(np.arange(R - 2, R))

"""Shared fixtures for the trace tests: where the real traces live (skip when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def find_shared_traces() -> Path | None:
    """The real-trace folder: $SEQMOE_SHARED/data/traces, else shared/ in or next to the repo."""
    repo = Path(__file__).resolve().parents[2]
    env = os.environ.get("SEQMOE_SHARED")
    if env:
        candidates = [Path(env) / "data/traces", Path(env)]
    else:
        candidates = [repo / "shared/data/traces", repo.parent / "shared/data/traces"]
    return next((c for c in candidates if (c / "deepseek-v2-lite-puffin").is_dir()), None)


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """Path of shared/data/traces; skips the test when the folder is not there."""
    found = find_shared_traces()
    if found is None:
        pytest.skip("real traces not found (shared/data/traces); set SEQMOE_SHARED to the shared folder")
    return found

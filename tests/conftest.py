"""Shared fixtures: tiny random traces, a cost model to match them, and where the real traces live."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from seqmoe.costs.profiles import HardwareProfile, ModelProfile
from seqmoe.trace.schema import RoutingTrace, TraceMeta

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background (`cmd &`): the Ctrl-C tests
    signal.signal(signal.SIGINT, signal.default_int_handler)  # need it, here and in the children they start


def make_trace(num_tokens=120, num_layers=3, num_experts=8, top_k=2, num_requests=3, seed=0, reuse=0.5) -> RoutingTrace:
    """A random trace with skewed popularity and some token-to-token reuse."""
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(num_experts, 0.7), size=num_layers)
    ids = np.zeros((num_tokens, num_layers, top_k), dtype=np.int16)
    for t in range(num_tokens):
        for l in range(num_layers):
            if t and rng.random() < reuse:
                ids[t, l] = ids[t - 1, l]
            else:
                ids[t, l] = rng.choice(num_experts, size=top_k, replace=False, p=pop[l])
    cuts = np.sort(rng.choice(np.arange(1, num_tokens), size=num_requests - 1, replace=False))
    offsets = np.concatenate([[0], cuts, [num_tokens]]).astype(np.int64)
    return RoutingTrace(expert_ids=ids, request_offsets=offsets, meta=TraceMeta(model="tiny", num_experts=num_experts, source="test"))


def drive(manager, trace: RoutingTrace) -> None:
    """Feed `trace` to `manager` as one request through a `Driver`, token by token (unlike `simulate`,
    the caller keeps the manager to inspect)."""
    from seqmoe.brain.manager import Driver

    d = Driver(manager)
    for t in range(trace.num_tokens):
        d.token_start(None, t == 0)
        for l in range(trace.num_layers):
            d.reveal(l, trace.expert_ids[t, l])
            d.layer_end(l)


def tiny_model(trace: RoutingTrace) -> ModelProfile:
    return ModelProfile(name="tiny", num_layers=trace.num_layers, num_experts=trace.num_experts, top_k=trace.top_k,
                        expert_bytes=1_000_000, layer_bytes=2_000_000, token_bytes=1_000_000)


def tiny_hardware(h2d_bytes_per_s: float = 1e10, copy_overhead_s: float = 1e-5) -> HardwareProfile:
    return HardwareProfile(name="tiny-hw", h2d_bytes_per_s=h2d_bytes_per_s, copy_overhead_s=copy_overhead_s,
                           hbm_bytes_per_s=1e12, device_memory_bytes=1 << 30)


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    """No test reads or writes the user's $SEQMOE_CACHE (the online forecaster writes there)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SEQMOE_CACHE", str(tmp_path_factory.mktemp("seqmoe-cache")))
    yield
    mp.undo()


@pytest.fixture
def trace() -> RoutingTrace:
    return make_trace()


def find_shared_traces() -> Path | None:
    """The real-trace folder: $SEQMOE_SHARED/data/traces, else shared/ in or next to the repo."""
    repo = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="session")
def tiny_forecaster(tmp_path_factory):
    """(folder, train, test): a seq2seq forecaster trained for one quick epoch on a random trace."""
    pytest.importorskip("torch")
    from seqmoe.brain.predict.train import train_seq_predictor
    from seqmoe.trace.io import save_trace

    d = tmp_path_factory.mktemp("seq")
    train, test = make_trace(num_tokens=300, seed=21), make_trace(num_tokens=80, seed=22)
    train_seq_predictor(train, d / "pred", epochs=1, hash_buckets=64, embed_dim=16, hidden_dim=16, query_dim=16,
                        num_streams=4, window=8, max_minutes=None, progress=False)
    save_trace(train, d / "train.safetensors")
    save_trace(test, d / "test.safetensors")
    return d, train, test

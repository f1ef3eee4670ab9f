"""The forecaster's long-range head: from the state before each token, how soon each expert is used.

One linear layer + sigmoid from the GRU state (what the forecaster has read of the tokens and the
routing so far) to rho^(G - 1) for every expert, G the tokens until its next use and rho the keep
value's discount of one token: the discounted wait the probabilistic Belady policy prices beyond its
forecast, learned from the state instead of from each expert's own history alone. It is fitted on
the trained forecaster's states (the forecaster stays as it is; training both together fitted the
head a little better and decided no better: docs/LOG.md).

    weights.update(fit_far_head(predictor, train))    # far_w [L * E, H], far_b [L * E]
"""

from __future__ import annotations

import math

import numpy as np

from seqmoe.brain.predict.buckets import trace_buckets
from seqmoe.trace.schema import RoutingTrace

RHO = math.exp(-0.5)
"""One token's discount at the policy's default tau (two tokens)."""
MAX_WAIT = 200
"""Waits are counted up to this many tokens (rho^199 is 0 in float32)."""
FIT_TOKENS = 60_000
"""Training tokens the head is fitted on at most (its targets take L * E floats per token)."""


def gru_states(pred, trace: RoutingTrace) -> np.ndarray:
    """[T, H] float32 the forecaster's state before each token (reset at each request, as in a replay)."""
    from seqmoe.brain.predict.seqmodel import gru_step  # numba: only when this runs

    w = pred.w
    routed = w["route_in"][trace.uids().reshape(trace.num_tokens, -1)].sum(1)
    x = routed + w["tok_in"][trace_buckets(trace, pred.config.hash_buckets)]
    starts = set(trace.request_offsets[:-1].tolist())
    out, h = np.zeros((trace.num_tokens, len(w["h0"])), np.float32), w["h0"]
    for t in range(trace.num_tokens):
        h = w["h0"] if t in starts else h
        out[t] = h
        h = gru_step(w, h, x[t])
    return out


def tokens_to_next_use(trace: RoutingTrace) -> np.ndarray:
    """[T, L * E] int16 tokens from t to each uid's next use after t (at most `MAX_WAIT`)."""
    T, N = trace.num_tokens, trace.num_layers * trace.num_experts
    used = np.zeros((T + 1, N), bool)
    u = trace.uids().reshape(T, -1)
    used[np.repeat(np.arange(T), u.shape[1]), u.reshape(-1)] = True
    nxt = np.full(N, T + MAX_WAIT, np.int64)
    out = np.zeros((T, N), np.int16)
    for t in range(T - 1, -1, -1):
        nxt = np.where(used[t + 1], t + 1, nxt)
        out[t] = np.minimum(nxt - t, MAX_WAIT)
    return out


def fit_far_head(pred, train: RoutingTrace, *, epochs: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """{"far_w", "far_b"} fitted by binary cross-entropy on the first `FIT_TOKENS` tokens of `train`."""
    import torch  # torch: only when this runs

    part = train.head(min(train.num_tokens, FIT_TOKENS))
    x = torch.from_numpy(gru_states(pred, part))
    y = torch.from_numpy(RHO ** (tokens_to_next_use(part).astype(np.float32) - 1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = torch.nn.Linear(x.shape[1], y.shape[1])
        opt = torch.optim.Adam(head.parameters(), 2e-3)
        for _ in range(epochs):
            for idx in torch.randperm(len(x)).split(512):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return {"far_w": head.weight.detach().numpy().copy(), "far_b": head.bias.detach().numpy().copy()}

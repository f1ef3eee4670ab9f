"""Probe (issue 12): does the forecaster's recurrent state say when an expert is next used, further
out than routing history can? Eviction alone, DeepSeek-V2-Lite routing.

    python benchmarks/reuse_head_probe.py --predictor results/ds/predictor \
        --train results/ds/train.safetensors --trace results/ds/test.safetensors [--max-tokens 4000]

Runs the trained forecaster's GRU over both splits (its state before each token: what the forecaster
has read of the tokens and routing so far), fits on the training split one linear layer + sigmoid
from that state to rho^(G - 1) for every expert, G the tokens until its next use (rho: the keep
value's discount of one token), then replays the held-out tokens with demand copies only, the
reference manager, and probabilistic Belady whose prior beyond the forecast is (a) seqmoe's reuse
table, (b) that table times the head's value of the current token. Prints copies / Belady's copies
per residency. docs/LOG.md has the numbers, and why wiring the head into seqmoe (forecast and
prefetch in front of it) did not pay.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from seqmoe.cache import belady_misses
from seqmoe.cache.forecast import ForecastPolicy
from seqmoe.config import DEFAULT_RESIDENCIES
from seqmoe.manager import System, capacity_for, start_placement
from seqmoe.predict.buckets import trace_buckets
from seqmoe.predict.checkpoints import load_seq_predictor
from seqmoe.predict.seqmodel import gru_step
from seqmoe.profiles import get_hardware_profile, get_model_profile
from seqmoe.sim import simulate
from seqmoe.trace.io import load_trace


def gru_states(pred, trace) -> np.ndarray:
    """[T, H] the forecaster's state before each token (reset at each request, as in a replay)."""
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


def tokens_to_next_use(trace) -> np.ndarray:
    """[T, L * E] tokens from t to each uid's next use after t (a large number when none)."""
    T, N = trace.num_tokens, trace.num_layers * trace.num_experts
    used = np.zeros((T + 1, N), bool)
    u = trace.uids().reshape(T, -1)
    used[np.repeat(np.arange(T), u.shape[1]), u.reshape(-1)] = True
    nxt = np.full((T + 1, N), 10 ** 9, np.int64)
    for t in range(T - 1, -1, -1):
        nxt[t] = np.where(used[t + 1], t + 1, nxt[t + 1])
    return nxt[:T] - np.arange(T)[:, None]


def fit_head(states, gaps, rho, epochs=3, seed=0):
    import torch

    torch.manual_seed(seed)
    x, y = torch.tensor(states), torch.tensor(rho ** np.minimum(gaps - 1, 200), dtype=torch.float32)
    head = torch.nn.Linear(x.shape[1], y.shape[1])
    opt = torch.optim.Adam(head.parameters(), 2e-3)
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(512):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return lambda s: torch.sigmoid(head(torch.tensor(s))).detach().numpy().astype(np.float64)


class HeadPrior(ForecastPolicy):
    """Probabilistic Belady whose prior beyond the forecast is the reuse table times the head's value."""

    head_values: np.ndarray  # [T, L * E]

    def _prior(self, end, nxt):
        return super()._prior(end, nxt) * self.head_values[min(max(end, 0) // self._L, len(self.head_values) - 1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictor", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--train-tokens", type=int, default=60000)
    p.add_argument("--residencies", default=",".join(map(str, DEFAULT_RESIDENCIES)))
    args = p.parse_args()
    train, test = load_trace(args.train).head(args.train_tokens), load_trace(args.trace).head(args.max_tokens)
    pred = load_seq_predictor(args.predictor)
    pred.check_trace(train)
    L = train.num_layers
    rho = np.exp(-L / (2.0 * L))  # one token's discount at ForecastPolicy's default tau
    head = fit_head(gru_states(pred, train), tokens_to_next_use(train), rho)
    values = head(gru_states(pred, test))
    model, hw = get_model_profile("deepseek-v2-lite"), get_hardware_profile("h100-pcie5")
    full = load_trace(args.train)
    print("| residency | reuse table | table x head |")
    print("|---|---|---|")
    for r in map(float, args.residencies.split(",")):
        C = capacity_for(r, L, test.num_experts, test.top_k)
        start = start_placement(full, C)
        n_opt = belady_misses(test.uids(), C, start)
        table, probe = ForecastPolicy.from_trace(full), HeadPrior.from_trace(full)
        probe.head_values = values
        copies = [simulate(test, System(name, pol), model=model, hardware=hw, capacity=C, start=start,
                           compiled=False).copies for name, pol in (("table", table), ("table x head", probe))]
        print(f"| {r:g} | " + " | ".join(f"{c / n_opt:.3f}" for c in copies) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A long-range head on the forecaster's state: does it tell eviction when an expert is next used,
beyond the two tokens the forecast covers? DeepSeek-V2-Lite routing (issues 12 and 27).

    python benchmarks/long_range_head.py [--joint-epochs 8] [--max-tokens 2000] [--residencies 0.25,0.45,0.65]

The head is one linear layer + sigmoid from the GRU state before each token (what the forecaster has
read of the tokens and routing so far) to rho^(G - 1) for every expert, G the tokens until its next
use (rho: the keep value's discount of one token). Two ways to get it:
- probe (`--joint-epochs 0`): the shipped forecaster (trained on the training split, cached) stays
  as it is; the head is fitted on its states over the first 60,000 training tokens;
- joint (`--joint-epochs N`): forecaster and head trained together from scratch for N epochs, the
  head's loss added to the forecaster's (a long-range loss shaping the state itself).
Then the held-out prompts are replayed (reference manager, h100-pcie5) with probabilistic Belady
whose prior beyond the forecast is the reuse table, or the table times the head's value of the
current token (never of a token whose routing is not revealed yet): eviction alone (demand copies),
behind the two-token forecast with deadline prefetch, and behind its rows of the current token only
(what `seqmoe` does with its head). Prints copies / Belady's misses and time.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from puffin_split import add_shared_flag, puffin_split

from seqmoe.brain.policies import belady_misses
from seqmoe.brain.policies.forecast import ForecastPolicy
from seqmoe.brain.manager import System, capacity_for, start_placement
from seqmoe.brain.predict.buckets import trace_buckets
from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.brain.predict.provide import seq_predictor_for
from seqmoe.brain.predict.far_head import RHO, fit_far_head, gru_states, tokens_to_next_use
from seqmoe.brain.predict.seqmodel import SeqPredictor
from seqmoe.costs.profiles import get_hardware_profile, get_model_profile
from seqmoe.brain.schedule.deadline import DeadlinePrefetcher
from seqmoe.sim import simulate


def fit_joint(train, cfg, epochs, seed=0):
    """Forecaster and head trained together from scratch: (SeqPredictor, head)."""
    import torch
    from tqdm import tqdm

    from seqmoe.brain.predict import train as T
    from seqmoe.brain.predict.seqnet import SeqNet

    torch.manual_seed(seed)
    net, head = SeqNet(cfg), torch.nn.Linear(cfg.hidden_dim, cfg.num_layers * cfg.num_experts)
    gaps = torch.from_numpy(tokens_to_next_use(train))
    buckets = trace_buckets(train, cfg.hash_buckets)
    requests = T.split_requests(train.num_requests, 0.08, seed)[0]
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    params = list(net.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=3e-3)
    W, S = 32, 16
    sched = T._cosine_schedule(opt, epochs * (T.make_streams(train, buckets, requests, S, W, rng).length // W))
    for _ in range(epochs):
        st, h = T.make_streams(train, buckets, requests, S, W, rng), None
        net.train()
        for w0 in tqdm(range(0, st.length, W), leave=False):
            batch = T.window_batch(st, w0, W)
            drop = torch.rand(batch["buckets"].shape, generator=gen) < 0.2
            x = net.gru_inputs(batch["ids"].flatten(0, 1), torch.where(drop, cfg.hash_buckets, batch["buckets"]).flatten())
            h_prev, h = net.run_gru(x.view(W, S, -1), batch["start"], h)
            h = h.detach()
            nv = int(batch["valid"].sum())
            if nv:
                lk = torch.randint(-1, cfg.num_layers, (nv, 2), generator=gen)
                loss = T.query_loss(*T._batch_queries(net, batch, h_prev, lk, torch.rand(nv, 2, generator=gen) < 0.2))
                sel = batch["valid"].reshape(-1)
                idx = torch.from_numpy(st.index[:, w0:w0 + W].T.copy()).reshape(-1)[sel]
                target = RHO ** (gaps[idx].float() - 1)
                loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(
                    head(h_prev.reshape(-1, h_prev.shape[-1])[sel]), target)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            sched.step()
    return SeqPredictor(cfg, net.export()), head


class CurrentToken(Predictor):
    """A two-token forecaster's rows of the current token only (what `seqmoe` reads with its head)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def begin_request(self):
        self.inner.begin_request()

    def begin_token(self, step, token_id):
        self.inner.begin_token(step, token_id)

    def observe(self, step, ids):
        self.inner.observe(step, ids)

    def predict(self, step):
        fc = self.inner.predict(step)
        if fc is None:
            return None
        keep = fc.steps < (fc.steps[0] // self.inner.L + 1) * self.inner.L
        return Forecast(fc.steps[keep], fc.probs[keep])


class HeadPrior(ForecastPolicy):
    """Probabilistic Belady whose prior beyond the forecast is the reuse table times the head's value
    of the current token (the one whose start the latest revealed position leads to)."""

    head_values: np.ndarray  # [T, L * E]

    def _prior(self, end, nxt):
        t = min((self._step + 1) // self._L, len(self.head_values) - 1)
        return super()._prior(end, nxt) * self.head_values[t]


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_flag(p)
    p.add_argument("--joint-epochs", type=int, default=0, help="0: probe the cached forecaster; N: train jointly")
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--residencies", default="0.25,0.45,0.65")
    args = p.parse_args()
    split = puffin_split(args.shared)
    if split is None:
        return 1
    train, test = split[0], split[1].head(args.max_tokens)
    pred = seq_predictor_for(None, train, progress=True).with_window(None, far_head=False)
    if args.joint_epochs:
        pred, head = fit_joint(train, pred.config, args.joint_epochs)
        with torch.no_grad():
            values = torch.sigmoid(head(torch.from_numpy(gru_states(pred, test)))).numpy().astype(np.float64)
    else:
        head = fit_far_head(pred, train)
        values = 1 / (1 + np.exp(-(gru_states(pred, test) @ head["far_w"].T + head["far_b"]).astype(np.float64)))
    model, hw = get_model_profile("deepseek-v2-lite"), get_hardware_profile("h100-pcie5")
    L = train.num_layers
    print("| residency | forecast | reuse table: copies / Belady, time s | table x head |")
    print("|---|---|---|---|")
    for r in map(float, args.residencies.split(",")):
        C = capacity_for(r, L, test.num_experts, test.top_k)
        start = start_placement(train, C)
        n_opt = belady_misses(test.uids(), C, start)
        for tokens, label in ((0, "none (eviction alone)"), (2, "two tokens (seqmoe-no-far-head)"),
                              (1, "the current token (seqmoe)")):
            cells = []
            for cls in (ForecastPolicy, HeadPrior):
                policy = cls.from_trace(train)
                policy.head_values = values
                system = System("probe", policy)
                if tokens:
                    forecaster = pred.with_window(0)
                    forecaster.check_trace(test)
                    if tokens == 1:
                        forecaster = CurrentToken(forecaster)
                    system = System("probe", policy, forecaster, DeadlinePrefetcher(policy))
                c = simulate(test, system, model=model, hardware=hw, capacity=C, start=start, compiled=False)
                cells.append(f"{c.copies / n_opt:.3f}, {c.time_s:.2f}")
            print(f"| {r:g} | {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

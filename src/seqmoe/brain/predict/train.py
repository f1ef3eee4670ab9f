"""Train the sequence forecaster (`seqmoe.brain.predict.seqmodel`) on a routing trace, on the CPU.

    info = train_seq_predictor(train, "results/predictor-deepseek", epochs=8, seed=0)
    pred = load_seq_predictor("results/predictor-deepseek")

Requests are split into a training part and a validation part (seeded, by whole request). The
training requests are packed into S parallel streams (shuffled every epoch); the GRU runs over
windows of W tokens per stream, its state carried across windows and reset at request starts
(truncated back-propagation through time). Each token is queried at a few random `l_known`
layers; the loss is the cross-entropy of K * softmax against the K experts really used, for every
later layer of the token and every layer of the next token of the same request. The epoch with
the best validation recall is kept and written as `model.safetensors` plus `config.json`.

This module imports torch; `seqmodel` (inference) does not.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from seqmoe.brain.predict.buckets import trace_buckets
from seqmoe.brain.predict.checkpoints import load_seq_predictor, save_checkpoint
from seqmoe.brain.predict.evaluate import default_horizons
from seqmoe.brain.predict.far_head import fit_far_head
from seqmoe.brain.predict.seqmodel import PredictorError, SeqConfig, SeqPredictor
from seqmoe.brain.predict.seqnet import SeqNet
from seqmoe.trace.schema import RoutingTrace, snapshot_trace

__all__ = ["load_seq_predictor", "train_seq_predictor"]


@dataclass
class Streams:
    """Requests packed into S parallel token streams (padding at the ends).

    Attributes:
        index: [S, N] int64 token index into the trace, -1 for padding.
        start: [S, N] bool, the token opens a request.
        has_next: [S, N] bool, the next token of the stream is in the same request.
        ids: [T, L, K] int64 expert ids of the whole trace.
        buckets: [T] int64 token buckets of the whole trace.
    """

    index: np.ndarray
    start: np.ndarray
    has_next: np.ndarray
    ids: torch.Tensor
    buckets: torch.Tensor

    @property
    def length(self) -> int:
        return self.index.shape[1]


def split_requests(num_requests: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) request indices, each sorted; a seeded share `val_fraction` validates."""
    if num_requests < 2:
        raise PredictorError(f"training needs at least 2 requests (one to validate), the trace has {num_requests}")
    if not 0.0 < val_fraction < 1.0:
        raise PredictorError(f"validation fraction must be in (0, 1), got {val_fraction}")
    n_val = min(max(1, round(val_fraction * num_requests)), num_requests - 1)
    perm = np.random.default_rng(seed).permutation(num_requests)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def make_streams(trace: RoutingTrace, buckets: np.ndarray, requests: np.ndarray, num_streams: int,
                 window: int, rng: np.random.Generator | None = None) -> Streams:
    """Pack `requests` (shuffled when `rng` is given) into streams of equal length (a multiple of `window`)."""
    off = trace.request_offsets
    order = rng.permutation(requests) if rng is not None else requests
    S = max(1, min(num_streams, len(order)))
    heap = [(0, s) for s in range(S)]
    parts: list[list[int]] = [[] for _ in range(S)]
    for r in order:  # each request joins the shortest stream: streams end close together
        n, s = heapq.heappop(heap)
        parts[s].append(int(r))
        heapq.heappush(heap, (n + int(off[r + 1] - off[r]), s))
    N = max(n for n, _ in heap)
    N = -(-N // window) * window
    index = np.full((S, N + 1), -1, dtype=np.int64)  # one extra column: "next" of the last token
    start = np.zeros((S, N + 1), dtype=bool)
    for s, reqs in enumerate(parts):
        if reqs:
            toks = np.concatenate([np.arange(off[r], off[r + 1]) for r in reqs])
            index[s, :len(toks)] = toks
            firsts = np.cumsum([0] + [int(off[r + 1] - off[r]) for r in reqs[:-1]])
            start[s, firsts] = True
    has_next = (index[:, 1:] >= 0) & ~start[:, 1:]
    return Streams(index[:, :N], start[:, :N], has_next[:, :N],
                   torch.from_numpy(trace.expert_ids.astype(np.int64)), torch.from_numpy(buckets))


def window_batch(st: Streams, w0: int, window: int) -> dict[str, torch.Tensor]:
    """Tensors of stream positions w0..w0+window-1, time-major ([W, S, ...])."""
    idx = torch.from_numpy(st.index[:, w0:w0 + window].T.copy())  # [W, S]
    nxt = torch.from_numpy(np.pad(st.index, ((0, 0), (0, 1)), constant_values=-1)[:, w0 + 1:w0 + window + 1].T.copy())
    ids = st.ids[idx.clamp(min=0)]  # [W, S, L, K]
    return {
        "valid": idx >= 0, "ids": ids, "next_ids": st.ids[nxt.clamp(min=0)],
        "buckets": st.buckets[idx.clamp(min=0)], "start": torch.from_numpy(st.start[:, w0:w0 + window].T.copy()),
        "has_next": torch.from_numpy(st.has_next[:, w0:w0 + window].T.copy()),
    }  # fmt: skip


def query_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of softmax rows against K-hot targets (weight 1/K each).

    Args:
        logits: [N, 2, L, E]; targets: [N, 2, L, K] int64 expert ids; mask: [N, 2, L] bool rows scored.
    """
    nll = torch.logsumexp(logits, dim=-1) - logits.gather(-1, targets).mean(dim=-1)  # [N, 2, L]
    return (nll * mask).sum() / mask.sum().clamp(min=1)


def _batch_queries(net: SeqNet, batch: dict, h_prev: torch.Tensor, l_known: torch.Tensor,
                   unknown: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query every valid token of a window at the given l_known ([Nv, Q]); returns logits, targets, mask."""
    cfg = net.cfg
    L, Q = cfg.num_layers, l_known.shape[1]
    sel = batch["valid"].reshape(-1)
    pick = lambda a: a.reshape(-1, *a.shape[2:])[sel]  # noqa: E731  [W, S, ...] -> [Nv, ...]
    ids = pick(batch["ids"])
    tok = torch.arange(len(ids)).repeat_interleave(Q)  # [Nv * Q] token of each query
    lk = l_known.reshape(-1)
    part = net.partial_sums(ids)[tok, lk + 1]  # [Nv * Q, Z]
    buckets = pick(batch["buckets"])[tok]
    if unknown is not None:
        buckets = torch.where(unknown.reshape(-1), cfg.hash_buckets, buckets)
    logits = net.query(pick(h_prev)[tok], part, lk, buckets)
    targets = torch.stack([ids[tok], pick(batch["next_ids"])[tok]], dim=1)  # [N, 2, L, K]
    later = torch.arange(L)[None, :] > lk[:, None]  # [N, L] rows of this token still ahead
    mask = torch.stack([later, pick(batch["has_next"])[tok][:, None].expand(-1, L)], dim=1)
    return logits, targets, mask


def horizon_hits(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, l_known: torch.Tensor,
                 horizons) -> tuple[np.ndarray, np.ndarray]:
    """Top-K hits and scored rows per horizon (horizon = rows ahead of l_known).

    Returns:
        hits [len(horizons)] int64 (true experts inside the top K), rows [len(horizons)] int64.
    """
    N, _, L, E = logits.shape
    K = targets.shape[-1]
    top = logits.topk(K, dim=-1).indices  # [N, 2, L, K]
    hits = (top[..., :, None] == targets[..., None, :]).any(-1).sum(-1)  # [N, 2, L]
    ahead = torch.arange(2 * L).view(1, 2, L) - l_known.view(-1, 1, 1)  # [N, 2, L]
    h_out, r_out = [], []
    for h in horizons:
        m = mask & (ahead == h)
        h_out.append(int(hits[m].sum()))
        r_out.append(int(m.sum()))
    return np.array(h_out), np.array(r_out)


def _validate(net: SeqNet, streams: Streams, horizons, window: int, seed: int) -> dict:
    """Validation loss and recall@K per horizon, 2 fixed l_known in [0, L-1] per token."""
    gen = torch.Generator().manual_seed(seed)
    L = net.cfg.num_layers
    hits, rows = np.zeros(len(horizons), np.int64), np.zeros(len(horizons), np.int64)
    loss_sum, n = 0.0, 0
    h = None
    net.eval()
    with torch.no_grad():
        for w0 in range(0, streams.length, window):
            batch = window_batch(streams, w0, window)
            x = net.gru_inputs(batch["ids"].flatten(0, 1), batch["buckets"].flatten()).view(window, streams.index.shape[0], -1)
            h_prev, h = net.run_gru(x, batch["start"], h)
            nv = int(batch["valid"].sum())
            if nv == 0:
                continue
            lk = torch.randint(0, L, (nv, 2), generator=gen)
            logits, targets, mask = _batch_queries(net, batch, h_prev, lk, None)
            loss_sum += float(query_loss(logits, targets, mask)) * nv
            n += nv
            a, b = horizon_hits(logits, targets, mask, lk.reshape(-1), horizons)
            hits, rows = hits + a, rows + b
    K = net.cfg.top_k
    recall = {int(h): float(x) / max(int(r) * K, 1) for h, x, r in zip(horizons, hits, rows)}
    return {"loss": loss_sum / max(n, 1), "recall_at_k": recall, "mean_recall": float(np.mean(list(recall.values())))}


def _train_epoch(net: SeqNet, opt, sched, streams: Streams, args: dict, gen: torch.Generator, bar,
                 deadline: float) -> tuple[float, bool]:
    """One pass over the streams; returns (mean training loss, stopped at the deadline)."""
    cfg, window, q = net.cfg, args["window"], args["queries_per_token"]
    net.train()
    h, total, n = None, 0.0, 0
    for w0 in range(0, streams.length, window):
        batch = window_batch(streams, w0, window)
        # Unknown-token dropout: the recursion feeds the GRU and the query tokens it cannot know.
        drop = torch.rand(batch["buckets"].shape, generator=gen) < args["unknown_prob"]
        x = net.gru_inputs(batch["ids"].flatten(0, 1), torch.where(drop, cfg.hash_buckets, batch["buckets"]).flatten())
        x = x.view(window, streams.index.shape[0], -1)
        h_prev, h = net.run_gru(x, batch["start"], h)
        h = h.detach()
        nv = int(batch["valid"].sum())
        if nv:
            lk = torch.randint(-1, cfg.num_layers, (nv, q), generator=gen)
            unknown = torch.rand(nv, q, generator=gen) < args["unknown_prob"]
            loss = query_loss(*_batch_queries(net, batch, h_prev, lk, unknown))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            total, n = total + float(loss.detach()), n + 1
        sched.step()
        bar.update(1)
        bar.set_postfix(loss=f"{total / max(n, 1):.3f}", refresh=False)
        if time.monotonic() > deadline and w0 + window < streams.length:
            return total / max(n, 1), True
    return total / max(n, 1), False


def _cosine_schedule(opt, total: int):
    """Linear warm-up over min(100, total / 10) steps, then cosine decay to 0 at `total` steps."""
    warm = max(1, min(100, total // 10))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))


def _epoch_row(epoch: int, loss: float, val: dict, elapsed: float, stopped: bool) -> dict:
    return {"epoch": epoch, "train_loss": loss, "val_loss": val["loss"], "val_mean_recall": val["mean_recall"],
            "val_recall_at_k": val["recall_at_k"], "elapsed_s": elapsed, "partial": stopped}


def _epoch_line(row: dict, num_layers: int) -> str:
    r = row["val_recall_at_k"]
    return (f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, val loss {row['val_loss']:.4f}, "
            f"val recall@K {row['val_mean_recall']:.4f} (h=1 {r[1]:.3f}, h=L {r[num_layers]:.3f}), "
            f"{row['elapsed_s']:.0f} s")


def train_seq_predictor(train: RoutingTrace, out_dir: str | os.PathLike, *, epochs: int = 8, seed: int = 0,
                        val_fraction: float = 0.08, hash_buckets: int = 8192, embed_dim: int = 256,
                        hidden_dim: int = 256, query_dim: int = 256, num_streams: int = 16, window: int = 32,
                        queries_per_token: int = 2, lr: float = 3e-3, unknown_prob: float = 0.2,
                        max_minutes: float | None = None, threads: int | None = None, far_head: bool = True,
                        progress: bool = True, log=None) -> dict:
    """Train a `SeqPredictor` on `train` and write it to `out_dir`.

    Args:
        train: training trace ([T, L, K] expert ids; token ids and vocab used when present).
        out_dir: folder for `model.safetensors` and `config.json` (created; files replaced atomically).
        epochs: passes over the training requests.
        seed: seeds the validation split, the initial weights, the stream shuffles and the sampling.
        val_fraction: share of requests held out to pick the best epoch.
        hash_buckets, embed_dim, hidden_dim, query_dim: architecture (see `SeqConfig`).
        num_streams, window: S parallel streams, W tokens of back-propagation per step.
        queries_per_token: random l_known values queried per token and step.
        lr: peak AdamW learning rate (linear warm-up, cosine decay).
        unknown_prob: probability of replacing a token bucket by "unknown" (GRU input and query).
        max_minutes: stop training after this long (the best epoch so far is kept; `training.cut_short`
            says so). None (default): no limit, so a seed gives one forecaster however busy the machine is
            (a cut run never reaches the learning rate's decay and forecasts worse).
        threads: torch CPU threads while training (default: torch's setting; restored afterwards).
        far_head: also fit the long-range head (`seqmoe.brain.predict.far_head`) on the trained forecaster.
        progress: show a progress bar.
        log: called with one line per epoch (validation numbers); None: silent.

    Returns:
        The `config.json` contents minus format fields: `training` (arguments, time, epochs run),
        `metrics` (best validation loss / recall per horizon) and `history` (one row per epoch).
    """
    args = {k: v for k, v in locals().items() if k not in ("train", "out_dir", "log", "progress")}
    if epochs < 1:
        raise PredictorError(f"epochs must be at least 1, got {epochs}")
    before = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        with torch.random.fork_rng(devices=[]):  # seed without touching the caller's global RNG
            torch.manual_seed(seed)
            info, cfg, weights = _fit(train, args, progress, log)
            if far_head:
                cfg, weights = with_far_head(cfg, weights, train, seed)
    finally:
        torch.set_num_threads(before)
    save_checkpoint(out_dir, cfg, weights, info)
    return info


def with_far_head(cfg: SeqConfig, weights: dict, train: RoutingTrace, seed: int = 0) -> tuple[SeqConfig, dict]:
    """(config, weights) of the forecaster with its long-range head fitted on `train`."""
    head = fit_far_head(SeqPredictor(cfg, weights), train, seed=seed)
    return dataclasses.replace(cfg, far_head=True), {**weights, **head}


def _fit(train: RoutingTrace, args: dict, progress: bool, log) -> tuple[dict, SeqConfig, dict]:
    """The training loop of `train_seq_predictor`: (info, config, best weights)."""
    t_start = time.monotonic()
    deadline = t_start + 60 * args["max_minutes"] if args["max_minutes"] else math.inf
    seed, window, S = args["seed"], args["window"], args["num_streams"]
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    cfg = SeqConfig(num_layers=train.num_layers, num_experts=train.num_experts, top_k=train.top_k,
                    **{k: args[k] for k in ("hash_buckets", "embed_dim", "hidden_dim", "query_dim")})
    buckets = trace_buckets(train, cfg.hash_buckets)
    train_req, val_req = split_requests(train.num_requests, args["val_fraction"], seed)
    val_streams = make_streams(train, buckets, val_req, S, window)
    horizons = [h for h in default_horizons(cfg.num_layers) if h < 2 * cfg.num_layers]
    net = SeqNet(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=args["lr"], weight_decay=1e-4)
    total = max(1, args["epochs"] * make_streams(train, buckets, train_req, S, window).length // window)
    sched = _cosine_schedule(opt, total)
    history, best, best_state = [], None, None
    bar = tqdm(total=total, disable=not progress, desc="train", unit="win", leave=False)
    for epoch in range(1, args["epochs"] + 1):
        streams = make_streams(train, buckets, train_req, S, window, rng)
        loss, stopped = _train_epoch(net, opt, sched, streams, args, gen, bar, deadline)
        val = _validate(net, val_streams, horizons, window, seed)
        history.append(_epoch_row(epoch, loss, val, time.monotonic() - t_start, stopped))
        if log is not None:
            log(_epoch_line(history[-1], cfg.num_layers))
        if best is None or val["mean_recall"] > best["mean_recall"]:
            best, best_state = {**val, "epoch": epoch}, {k: v.clone() for k, v in net.state_dict().items()}
        if stopped:
            break
    bar.close()
    net.load_state_dict(best_state)
    cut = bool(history[-1]["partial"])  # only a stop at the deadline ends the loop early
    if cut and log is not None:
        log(f"stopped at the {args['max_minutes']:g}-minute limit in epoch {len(history)} of {args['epochs']}: "
            "this forecaster is worse than the same seed trains without a limit")
    info = {
        "training": {**args, "seconds": time.monotonic() - t_start, "epochs_run": len(history), "cut_short": cut,
                     "num_train_requests": len(train_req), "num_val_requests": len(val_req),
                     "trace": {"model": train.meta.model, "source": train.meta.source, "tokens": train.num_tokens}},
        "metrics": {"val_loss": best["loss"], "val_mean_recall": best["mean_recall"],
                    "val_recall_at_k": best["recall_at_k"], "best_epoch": best["epoch"]},
        "history": history,
    }  # fmt: skip
    return info, cfg, net.export()


class OnlineTrainer:
    """One network trained round after round, each round one pass over a snapshot of recent routing
    (the online learner's work, `seqmoe.brain.predict.online`). Deterministic: seeded, one torch thread.

    Args:
        cfg: the forecaster's architecture.
        seed: seeds the initial weights, the stream shuffles and the query sampling.
        weights: start from these (`SeqNet.export` names), else fresh.
        lr: constant AdamW learning rate; the other arguments as `train_seq_predictor`'s.
    """

    def __init__(self, cfg: SeqConfig, *, seed: int = 0, weights: dict | None = None, lr: float = 1e-3,
                 num_streams: int = 8, window: int = 32, queries_per_token: int = 2,
                 unknown_prob: float = 0.2) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = SeqNet(cfg)
        if weights is not None:
            self.net.load_exported(weights)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=1e-4)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: 1.0)
        self.rng, self.gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
        self.args = {"window": window, "queries_per_token": queries_per_token, "unknown_prob": unknown_prob,
                     "num_streams": num_streams}

    def round(self, ids: np.ndarray, buckets: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        """Train on one snapshot (`ids` [T, L, K], token `buckets` [T], `starts` [T]: a request opens);
        the weights after it (`SeqNet.export`)."""

        trace = snapshot_trace(ids, starts, self.net.cfg.num_experts)
        streams = make_streams(trace, np.asarray(buckets, dtype=np.int64), np.arange(trace.num_requests),
                               self.args["num_streams"], self.args["window"], self.rng)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _train_epoch(self.net, self.opt, self.sched, streams, self.args, self.gen, tqdm(disable=True), math.inf)
        finally:
            torch.set_num_threads(before)
        return self.net.export()

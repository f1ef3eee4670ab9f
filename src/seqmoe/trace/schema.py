"""`RoutingTrace`: which experts every token used at every MoE layer.

A trace holds requests back to back in decode order. Shapes use T tokens, L MoE layers,
K experts per token (top-k), R requests. Construct one directly or through `seqmoe.trace.io`::

    trace = RoutingTrace(expert_ids=ids, request_offsets=np.array([0, T]),
                         meta=TraceMeta(model="tiny", num_experts=8, source="synthetic"))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from seqmoe.base.errors import UserError


class TraceError(UserError, ValueError):
    """A trace is malformed; the message says what and where."""


@dataclass(frozen=True, kw_only=True)
class TraceMeta:
    """Facts about where a trace came from."""

    model: str = "unknown"
    """Model the routing was recorded from (free text, e.g. `deepseek-v2-lite`)."""
    num_experts: int
    """E: routed experts per MoE layer."""
    source: str = "unknown"
    """Where the trace came from (importer name and path, or generator)."""
    extra: dict = field(default_factory=dict)
    """Anything else worth keeping (JSON-serialisable)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class RoutingTrace:
    """Routing of T tokens through L MoE layers, K experts each.

    Attributes:
        expert_ids: [T, L, K] int16, expert ids per token and layer, in router output order.
        request_offsets: [R + 1] int64, token offsets of requests; request r is tokens
            `request_offsets[r]:request_offsets[r + 1]`. Starts at 0, ends at T, strictly increasing.
        meta: model, E and source.
        gate_weights: optional [T, L, K] float32, the router weights of `expert_ids`.
        token_ids: optional [T] int32, token ids (indices into `vocab` when imported from strings).
        vocab: optional token strings that `token_ids` index.
        pregate_logits: optional [T, L, H, E] float16, pre-gating scores for a horizon of H layers:
            `pregate_logits[t, l, h - 1]` are the router logits that MoE layer l + h's router gives
            to the hidden state entering MoE layer l's router (token t), for h = 1..H; NaN where
            l + h >= L. Written by `seqmoe.arch.collect` with `pregate=H`.
        router_logits: optional [T, L, E] float32, each layer's own router logits for token t
            (what cache-aware routing compares experts by). Written by `seqmoe.arch.collect` with
            `router_logits=True`.
    """

    expert_ids: np.ndarray
    request_offsets: np.ndarray
    meta: TraceMeta
    gate_weights: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    vocab: tuple[str, ...] | None = None
    pregate_logits: np.ndarray | None = None
    router_logits: np.ndarray | None = None

    def __post_init__(self) -> None:
        ids = self.expert_ids
        if not isinstance(ids, np.ndarray) or ids.ndim != 3:
            raise TraceError(f"expert_ids must be a [T, L, K] array, got shape {getattr(ids, 'shape', None)}")
        T, L, K = ids.shape
        if T == 0 or L == 0 or K == 0:
            raise TraceError(f"expert_ids has an empty dimension: shape (T, L, K) = {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TraceError(f"expert_ids must be integers, got {ids.dtype}")
        E = self.meta.num_experts
        if E <= 0:
            raise TraceError(f"num_experts must be positive, got {E}")
        bad = (ids < 0) | (ids >= E)
        if bad.any():
            t, l, k = map(int, np.argwhere(bad)[0])
            raise TraceError(
                f"expert id {int(ids[t, l, k])} out of range [0, {E}) at token {t}, layer {l}, slot {k}"
            )
        if K > 1:
            srt = np.sort(ids, axis=2)
            dup = (srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2)
            if dup.any():
                t, l = map(int, np.argwhere(dup)[0])
                raise TraceError(f"token {t}, layer {l} lists an expert twice: {ids[t, l].tolist()}")
        off = self.request_offsets
        if off.ndim != 1 or len(off) < 2 or off[0] != 0 or off[-1] != T:
            raise TraceError(f"request_offsets must run from 0 to T={T}, got {off[:3].tolist()}...{off[-2:].tolist()}")
        empty = np.flatnonzero(np.diff(off) <= 0)
        if len(empty):
            raise TraceError(f"request {int(empty[0])} is empty (offsets {off[empty[0]]}..{off[empty[0] + 1]})")
        if self.gate_weights is not None and self.gate_weights.shape != ids.shape:
            raise TraceError(f"gate_weights shape {self.gate_weights.shape} != expert_ids shape {ids.shape}")
        if self.token_ids is not None:
            if self.token_ids.shape != (T,):
                raise TraceError(f"token_ids shape {self.token_ids.shape} != ({T},)")
            if self.vocab is not None and len(self.token_ids) and int(self.token_ids.max()) >= len(self.vocab):
                raise TraceError(f"token id {int(self.token_ids.max())} outside vocab of {len(self.vocab)}")
        pre = self.pregate_logits
        if pre is not None:
            if pre.ndim != 4 or pre.shape[:2] != (T, L) or pre.shape[3] != E or pre.shape[2] == 0:
                raise TraceError(f"pregate_logits shape {pre.shape} is not [T={T}, L={L}, H>0, E={E}]")
            if not np.issubdtype(pre.dtype, np.floating):
                raise TraceError(f"pregate_logits must be floating point, got {pre.dtype}")
        own = self.router_logits
        if own is not None and (own.shape != (T, L, E) or not np.issubdtype(own.dtype, np.floating)):
            raise TraceError(f"router_logits must be a floating [T={T}, L={L}, E={E}] array, got {own.dtype} "
                             f"{own.shape}")

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.expert_ids.shape[0]

    @property
    def num_layers(self) -> int:
        """L."""
        return self.expert_ids.shape[1]

    @property
    def top_k(self) -> int:
        """K."""
        return self.expert_ids.shape[2]

    @property
    def num_experts(self) -> int:
        """E."""
        return self.meta.num_experts

    @property
    def num_requests(self) -> int:
        """R."""
        return len(self.request_offsets) - 1

    def request_ids(self) -> np.ndarray:
        """[T] int64: the request index of every token."""
        return np.repeat(np.arange(self.num_requests), np.diff(self.request_offsets))

    def uids(self) -> np.ndarray:
        """[T, L, K] int64 global expert ids, `uid = layer_id * E + expert_id`."""
        return self.expert_ids.astype(np.int64) + (np.arange(self.num_layers) * self.num_experts)[None, :, None]

    def select_requests(self, requests) -> RoutingTrace:
        """A new trace holding the given requests (indices, in the given order)."""
        requests = np.asarray(requests, dtype=np.int64)
        if len(requests) == 0:
            raise TraceError("cannot select zero requests")
        off = self.request_offsets
        idx = np.concatenate([np.arange(off[r], off[r + 1]) for r in requests])
        lengths = off[requests + 1] - off[requests]
        return dataclasses.replace(
            self,
            expert_ids=self.expert_ids[idx],
            request_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            gate_weights=None if self.gate_weights is None else self.gate_weights[idx],
            token_ids=None if self.token_ids is None else self.token_ids[idx],
            pregate_logits=None if self.pregate_logits is None else self.pregate_logits[idx],
            router_logits=None if self.router_logits is None else self.router_logits[idx],
        )

    def head(self, num_tokens: int) -> RoutingTrace:
        """The first `num_tokens` tokens (whole requests, the last one cut)."""
        n = min(num_tokens, self.num_tokens)
        off = self.request_offsets
        keep = off[off < n]
        return dataclasses.replace(
            self,
            expert_ids=self.expert_ids[:n],
            request_offsets=np.concatenate([keep, [n]]).astype(np.int64),
            gate_weights=None if self.gate_weights is None else self.gate_weights[:n],
            token_ids=None if self.token_ids is None else self.token_ids[:n],
            pregate_logits=None if self.pregate_logits is None else self.pregate_logits[:n],
            router_logits=None if self.router_logits is None else self.router_logits[:n],
        )


def dims(x) -> tuple[int, int, int]:
    """(L, E, K) of a trace, a model profile, or anything with `num_layers`, `num_experts`, `top_k`."""
    return int(x.num_layers), int(x.num_experts), int(x.top_k)


def check_dims(what: str, got, want, hint: str = "pick the profile of the model the trace was recorded from", *,
               against: str | None = None) -> None:
    """UserError unless `got` and `want` (traces, profiles, predictors' configs) share L, E and K.

    The message calls `want` `against`, else by its `name` (a model profile), else "the model".
    """
    a, b = dims(got), dims(want)
    if a != b:
        name = getattr(want, "name", None)
        of = against or (f"model profile {name!r}" if name else "the model")
        raise UserError(f"{what} has L={a[0]}, E={a[1]}, K={a[2]} but {of} has L={b[0]}, E={b[1]}, K={b[2]}; {hint}")


def placeholder_trace(L: int, E: int, K: int, name: str) -> RoutingTrace:
    """A one-token trace of shape (L, E, K): what train-free systems and the state machine read dims from."""
    ids = np.broadcast_to(np.arange(K, dtype=np.int16), (1, L, K)).copy()
    return RoutingTrace(expert_ids=ids, request_offsets=np.array([0, 1], np.int64),
                        meta=TraceMeta(model=name, num_experts=E, source="placeholder"))


def snapshot_trace(ids: np.ndarray, starts: np.ndarray, num_experts: int) -> RoutingTrace:
    """A snapshot's routing ([T, L, K] ids, [T] request starts) as a trace (its first token opens a request)."""
    starts = starts.copy()
    starts[0] = True
    offsets = np.append(np.flatnonzero(starts), len(starts)).astype(np.int64)
    return RoutingTrace(expert_ids=np.ascontiguousarray(ids, dtype=np.int16), request_offsets=offsets,
                        meta=TraceMeta(model="online", num_experts=num_experts, source="online snapshot"))

"""Drafters: guesses of the next tokens, which the sequence forecaster reads as look-ahead.

Expert routing follows the tokens, so a guessed next token lets the forecaster forecast the next
token's routing as if it were known. A guess is worth what its accuracy says: every drafted token
comes with a confidence, and `SeqPredictor` mixes the drafted forecast with the undrafted one by it.

- `NgramDrafter`: prompt lookup over the request's own tokens (the longest of its last 1-3 tokens
  seen before in the request proposes what followed them then). Its confidence is its own hit rate,
  counted per match length and depth over every token it has seen (`fit` replays a training trace
  first; live it starts from `PRIOR_HIT_RATE` and learns as it goes).
- `TrueTokenDrafter`: the replayed trace's true next tokens, confidence 1: the lever's ceiling.

The simulator and the runtime drive a drafter alike, through the forecaster: `begin_request`, then per
token `see(t, token_id)` with the token's input id, then `draft(n)`.
"""

from __future__ import annotations

import copy

from typing import Protocol

import numpy as np

from seqmoe.base.errors import UserError
from seqmoe.trace.schema import RoutingTrace

DRAFTERS = ("none", "ngram")
"""`--draft` choices: no drafts, `NgramDrafter` (`TrueTokenDrafter` is the oracle system
`seqmoe-oracle-draft`'s)."""
MAX_MATCH = 3
"""Longest suffix the n-gram drafter looks up."""
PRIOR_HIT_RATE = (0.2, 0.4, 0.6)
"""Hit rate of a 1-, 2- and 3-token match before the drafter has counted its own (measured on the
shipped tiny training trace and on DeepSeek-V2-Lite's; docs/LOG.md); a depth-d guess starts at
this times `PRIOR_DEPTH_DECAY ** (d - 1)`."""
PRIOR_DEPTH_DECAY = 0.7
PRIOR_WEIGHT = 8.0
"""Pseudo-counts of the prior in each confidence."""


class Drafter(Protocol):
    def begin_request(self) -> None:
        """A new request: forget its tokens (not what was learned about accuracy)."""

    def see(self, t: int, token_id: int | None) -> None:
        """Token `t` (global index in decode order) starts with input id `token_id` (None: unknown)."""

    def draft(self, n: int) -> tuple[list[int], list[float]]:
        """Guesses of tokens t + 1 .. t + m (m <= n, possibly 0) and the confidence of each."""

    place: object | None
    """What a batched replay points at each step's trace tokens (`TrueTokenDrafter`'s), or None."""

    def set_row(self, row: int) -> None:
        """Its sequence is row `row` of the step that starts (a lane of a batch)."""


class NgramDrafter:
    """Prompt-lookup drafts over the request's own tokens, priced by their measured hit rate."""

    place = None

    def __init__(self, max_depth: int = 20) -> None:
        self.max_depth = max_depth
        depth = np.arange(max_depth)
        prior = np.array(PRIOR_HIT_RATE)[:, None] * PRIOR_DEPTH_DECAY ** depth[None, :]  # [match, depth]
        self.hits = prior * PRIOR_WEIGHT
        self.tries = np.full_like(prior, PRIOR_WEIGHT)
        self.begin_request()

    def set_row(self, row: int) -> None:
        pass

    def begin_request(self) -> None:
        self._tokens: list[int] = []
        self._follower: list[dict] = [{} for _ in range(MAX_MATCH)]  # per n: last n tokens -> index after
        self._pending: dict[int, list[tuple[int, int, int]]] = {}  # index -> [(guess, match, depth)]
        self._match, self._start = 0, 0

    def see(self, t: int, token_id: int | None) -> None:
        toks = self._tokens
        if token_id is None:  # an unknown token breaks every match
            self.begin_request()
            return
        i = len(toks)
        for guess, m, d in self._pending.pop(i, ()):
            self.tries[m - 1, d - 1] += 1
            self.hits[m - 1, d - 1] += guess == token_id
        toks.append(int(token_id))
        for n in range(1, MAX_MATCH + 1):  # what the n tokens before this one were followed by
            if i >= n:
                self._follower[n - 1][tuple(toks[i - n:i])] = i
        self._match = 0
        for n in range(min(MAX_MATCH, i + 1), 0, -1):  # the longest suffix seen before
            j = self._follower[n - 1].get(tuple(toks[i + 1 - n:]))
            if j is not None:
                self._match, self._start = n, j
                break

    def draft(self, n: int) -> tuple[list[int], list[float]]:
        if not self._match:
            return [], []
        toks, i, m = self._tokens, len(self._tokens), self._match
        guesses = toks[self._start:self._start + min(n, self.max_depth)]  # what followed the match then
        for d, g in enumerate(guesses, start=1):
            self._pending.setdefault(i - 1 + d, []).append((g, m, d))
        conf = (self.hits[m - 1, :len(guesses)] / self.tries[m - 1, :len(guesses)]).tolist()
        return guesses, conf

    def fit(self, trace: RoutingTrace) -> NgramDrafter:
        """Count its hit rates on `trace`'s requests (drafting at every token), then start afresh."""
        if trace.token_ids is None:
            return self
        ids, off = trace.token_ids.tolist(), trace.request_offsets.tolist()
        for r in range(len(off) - 1):
            self.begin_request()
            for t in range(off[r], off[r + 1]):
                self.see(t, ids[t])
                self.draft(self.max_depth)
        self.begin_request()
        return self


class TrueTokenDrafter:
    """The replayed trace's true next tokens (within the request), confidence 1: an oracle. A trace
    without token ids has none to give: no drafts. In a batched replay the token a lane decodes is
    not the step's index: `place.tokens` holds the step's trace tokens, one per row (the replay sets
    it), and the drafter of row `set_row` reads its own; copies (a batch's lanes) share `place`."""

    def __init__(self, trace: RoutingTrace) -> None:
        self._ids = [] if trace.token_ids is None else trace.token_ids.tolist()
        self._off = trace.request_offsets
        self.place = _Place()
        self._t, self._row = -1, 0

    def __deepcopy__(self, memo) -> TrueTokenDrafter:
        return copy.copy(self)  # the trace's tokens and the place are shared, the position is not

    def begin_request(self) -> None:
        pass

    def set_row(self, row: int) -> None:
        self._row = row

    def see(self, t: int, token_id: int | None) -> None:
        self._t = t if self.place.tokens is None else self.place.tokens[self._row]

    def draft(self, n: int) -> tuple[list[int], list[float]]:
        t = self._t
        if not self._ids:
            return [], []
        end = int(self._off[np.searchsorted(self._off, t, side="right")])  # the request's end
        guesses = self._ids[t + 1:min(end, t + 1 + n)]
        return guesses, [1.0] * len(guesses)


class _Place:
    """The step's trace tokens, one per row, while a batched replay runs (else None)."""

    tokens: list[int] | None = None


def make_drafter(kind: str, train: RoutingTrace | None = None) -> Drafter | None:
    """The drafter `kind` names (one of `DRAFTERS`), its hit rates counted on `train` when that has
    token ids; None for "none"."""
    if check_draft(kind) == "none":
        return None
    drafter = NgramDrafter()
    return drafter.fit(train) if train is not None else drafter


def check_draft(kind: str) -> str:
    """`kind`, or UserError naming the choices."""
    if kind not in DRAFTERS:
        raise UserError(f"unknown drafter {kind!r}; choose one of: {', '.join(DRAFTERS)}")
    return kind

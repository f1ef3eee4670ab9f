"""Pre-gating computed live: what a trace collected with `pregate=H` records, from the running model.

The router hook of each MoE layer notes its input (`note_input`: a reference, no work); when a
predictor asks for the row of position (t, l) (`row`, as `PregatePredictor` does at l's reveal),
the routers of layers l + 1 .. l + H are applied to that layer's input of the forward, all its
positions at once (as the collector does, so the numbers are the collector's), rounded to float16
and turned into probabilities by the same `pregate_probs`. A forward over several positions (a
prompt, replayed into the state machine after it ran) keeps every layer's input, so each replayed
position gets its own row; a forward of B rows holds B x N inputs, row i's at i x N + position
(`row(step, i)`, asked by lane i's predictor). Inline control only: a posted decode step's
activations are not the host's to keep.
"""

from __future__ import annotations

import numpy as np
import torch

from seqmoe.arch import unpack_router_output
from seqmoe.brain.predict.pregate import pregate_probs


class LivePregate:
    """Pre-gate rows of the running model (`PregatePredictor`'s live source).

    Args:
        routers: the MoE layers' router modules, in order.
        horizon: H, later layers scored (the training trace's, whose fusion weights the system fitted).
        num_experts, top_k: E, K.
    """

    def __init__(self, routers, horizon: int, num_experts: int, top_k: int) -> None:
        self.routers, self.H, self.E, self.K = routers, horizon, num_experts, top_k
        self.num_layers = len(routers)
        self._inputs: list[torch.Tensor | None] = [None] * self.num_layers
        self._logits: list[np.ndarray | None] = [None] * self.num_layers  # [N, H, E] float16, made when asked
        self._first = 0  # the token index of the forward's first position
        self._rows = 1  # sequences in the forward

    def note_input(self, layer: int, x: torch.Tensor, first_token: int, rows: int = 1) -> None:
        """Layer `layer`'s router got `x` ([..., hidden]) in a forward of `rows` sequences whose first
        position is token `first_token`."""
        if layer == 0:
            self._inputs, self._logits = [None] * self.num_layers, [None] * self.num_layers
            self._first, self._rows = first_token, rows
        self._inputs[layer] = x.detach().reshape(-1, x.shape[-1])
        self._logits[layer] = None

    def row(self, step: int, row: int = 0) -> np.ndarray:
        """[H, E] `pregate_probs` of position `step` of the forward's row `row` (NaN where l + h >= L,
        or where its input is gone)."""
        t, l = divmod(step, self.num_layers)
        x = self._inputs[l]
        per_row = 0 if x is None else x.shape[0] // self._rows
        i = row * per_row + t - self._first
        if x is None or not 0 <= t - self._first < per_row or row >= self._rows:
            return np.full((self.H, self.E), np.nan, np.float32)
        if self._logits[l] is None:
            self._logits[l] = self._score(l, x)
        return pregate_probs(self._logits[l][i], self.K)

    @torch.no_grad()
    def _score(self, l: int, x: torch.Tensor) -> np.ndarray:
        out = np.full((x.shape[0], self.H, self.E), np.nan, np.float16)
        for h in range(1, min(self.H, self.num_layers - 1 - l) + 1):
            router = self.routers[l + h]
            # .forward, not __call__: the later router's own hooks (routing events) must not fire
            z, _, _ = unpack_router_output(router, router.forward(x))
            out[:, h - 1] = z.float().cpu().to(torch.float16).numpy()
        return out

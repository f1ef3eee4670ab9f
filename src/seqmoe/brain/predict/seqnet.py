"""`SeqNet`: the PyTorch twin of the sequence forecaster (`seqmoe.brain.predict.seqmodel.SeqPredictor`),
batched and teacher-forced, which `seqmoe.brain.predict.train` fits and exports to the inference weights.

This module imports torch; `seqmodel` (inference) does not.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from seqmoe.brain.predict.seqmodel import SeqConfig


class SeqNet(nn.Module):
    """PyTorch twin of `SeqPredictor` (same weights, same maths, batched and teacher-forced)."""

    def __init__(self, cfg: SeqConfig) -> None:
        super().__init__()
        self.cfg = cfg
        L, E, K, B = cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hash_buckets
        D, H, Z, LE = cfg.embed_dim, cfg.hidden_dim, cfg.query_dim, cfg.num_layers * cfg.num_experts
        self.route_in = nn.Parameter(torch.randn(LE, D) / math.sqrt(L * K))
        self.tok_in = nn.Parameter(torch.randn(B + 1, D) * 0.1)
        self.h0 = nn.Parameter(torch.zeros(H))
        self.gru = nn.GRUCell(D, H)
        self.q_h = nn.Linear(H, Z)
        self.q_part = nn.Parameter(torch.randn(LE, Z) / math.sqrt(L * K))
        self.q_tok = nn.Parameter(torch.randn(B + 1, Z) * 0.1)
        self.q_layer = nn.Parameter(torch.randn(L + 1, Z) * 0.1)
        self.q_norm = nn.LayerNorm(Z)
        self.mlp = nn.Linear(Z, Z)
        self.out = nn.Linear(Z, 2 * LE)
        self.register_buffer("layer_base", torch.arange(L) * E, persistent=False)  # [L] uid of expert 0

    def _row_sums(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[N, L, K] expert ids -> [N, L, cols]: per layer, the sum of the K rows `table[l * E + e]`
        (= multi-hot @ table, without the multi-hot)."""
        N, L, K = ids.shape
        uids = ids + self.layer_base[:, None]
        return nn.functional.embedding_bag(uids.reshape(N * L, K), table, mode="sum").view(N, L, -1)

    def gru_inputs(self, ids: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
        """[N, L, K] expert ids, [N] int64 buckets -> [N, D] GRU inputs."""
        N, L, K = ids.shape
        uids = (ids + self.layer_base[:, None]).reshape(N, L * K)
        return nn.functional.embedding_bag(uids, self.route_in, mode="sum") + self.tok_in[buckets]

    def partial_sums(self, ids: torch.Tensor) -> torch.Tensor:
        """[N, L, K] expert ids -> [N, L + 1, Z]; entry j = q_part rows summed over layers < j,
        i.e. the partial-routing term of a query with l_known = j - 1."""
        per_layer = self._row_sums(self.q_part, ids)
        return torch.cat([torch.zeros_like(per_layer[:, :1]), per_layer.cumsum(dim=1)], dim=1)

    def run_gru(self, x: torch.Tensor, start: torch.Tensor, h: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run over a window.

        Args:
            x: [W, S, D] inputs; start: [W, S] bool, the token opens a request (state resets to h0);
            h: [S, H] state carried from the previous window, or None.

        Returns:
            (h_prev [W, S, H], the state each token's query sees, i.e. after the tokens before it;
             h_last [S, H], the state after the window).
        """
        W, S, _ = x.shape
        if h is None:
            h = self.h0.expand(S, -1)
        prev = []
        for w in range(W):
            h = torch.where(start[w, :, None], self.h0.expand(S, -1), h)
            prev.append(h)
            h = self.gru(x[w], h)
        return torch.stack(prev), h

    def query(self, h_prev: torch.Tensor, part: torch.Tensor, l_known: torch.Tensor,
              buckets: torch.Tensor) -> torch.Tensor:
        """Logits of the two-token head.

        Args:
            h_prev: [N, H] GRU state before the token; part: [N, Z] partial-routing term
            (`partial_sums(ids)[:, l_known + 1]`); l_known: [N] int64 in [-1, L - 1]; buckets: [N] int64.

        Returns:
            [N, 2, L, E] logits: [:, 0] this token, [:, 1] the next token.
        """
        pre = self.q_h(h_prev) + part + self.q_tok[buckets] + self.q_layer[l_known + 1]
        z1 = torch.relu(self.q_norm(pre))
        z = z1 + torch.relu(self.mlp(z1))
        cfg = self.cfg
        return self.out(z).view(-1, 2, cfg.num_layers, cfg.num_experts)

    def export(self) -> dict[str, np.ndarray]:
        """Weights by the names `SeqPredictor` reads (PyTorch layout)."""
        return {k: v.detach().cpu().numpy().astype(np.float32).copy() for k, v in self._named().items()}

    def load_exported(self, weights: dict[str, np.ndarray]) -> None:
        """Set every weight from `export`'s names and layout."""
        with torch.no_grad():
            for name, param in self._named().items():
                param.copy_(torch.from_numpy(np.asarray(weights[name], dtype=np.float32)))

    def _named(self) -> dict[str, torch.Tensor]:
        return {
            "route_in": self.route_in, "tok_in": self.tok_in, "h0": self.h0,
            "gru_w_ih": self.gru.weight_ih, "gru_w_hh": self.gru.weight_hh,
            "gru_b_ih": self.gru.bias_ih, "gru_b_hh": self.gru.bias_hh,
            "q_h_w": self.q_h.weight, "q_h_b": self.q_h.bias, "q_part": self.q_part, "q_tok": self.q_tok,
            "q_layer": self.q_layer, "q_norm_w": self.q_norm.weight, "q_norm_b": self.q_norm.bias,
            "mlp_w": self.mlp.weight, "mlp_b": self.mlp.bias, "out_w": self.out.weight, "out_b": self.out.bias,
        }  # fmt: skip

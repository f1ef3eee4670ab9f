"""The running batch's KV cache: rows of different lengths in one transformers `DynamicCache`,
left-padded to a common length, with the attention mask that hides the padding.

Continuous batching in `seqmoe serve` keeps the model's own cache class and masks, as
`model.generate` does for a left-padded batch: a request is prefilled alone into its own cache,
then its keys and values join the batch's (`join`); a finished row leaves (`keep_rows`), and
padding every row has is cut. transformers' own continuous batching (`generate_batch`) packs the
rows' tokens into one sequence over a paged cache; the offloaded runtime would then see one
sequence, not B, so seqmoe does not use it.

    batch = BatchKV.alone(cache, length)          # a prefilled request
    batch = batch.join(BatchKV.alone(other, n))
    batch.mask, batch.positions                   # for the next decode step's forward
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def why_one_at_a_time(cache) -> str | None:
    """Why the batcher must decode one request at a time (None: it may batch): every layer of `cache` (a
    fresh `DynamicCache` of the model) must keep its whole history as [B, H, S, D] keys and values that rows
    can be padded and joined in, which sliding-window layers do not."""
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", [None])):
        return "the model's cache has sliding-window layers, which rows cannot be padded and joined in"
    return None


@dataclass
class BatchKV:
    """B rows of one cache: `cache`'s keys and values [B, H, S, D] per layer, `mask` [B, S] (1: a
    real position), `lengths` [B] the real positions of each row."""

    cache: object
    mask: torch.Tensor
    lengths: list[int]

    @classmethod
    def alone(cls, cache, length: int) -> BatchKV:
        """One row: a request's own cache after its prompt (`length` positions)."""
        device = cache.layers[0].keys.device
        return cls(cache, torch.ones((1, length), dtype=torch.long, device=device), [length])

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def positions(self) -> torch.Tensor:
        """[B, 1] the position of each row's next token."""
        return torch.tensor(self.lengths, dtype=torch.long, device=self.mask.device).view(-1, 1)

    def step_mask(self) -> torch.Tensor:
        """[B, S + 1]: the mask of a decode step's forward (the new position real in every row)."""
        return torch.cat([self.mask, self.mask.new_ones((self.rows, 1))], dim=1)

    def stepped(self, mask: torch.Tensor) -> None:
        """The decode step with `mask` (`step_mask`) ran: every row gained one position."""
        self.mask = mask
        self.lengths = [n + 1 for n in self.lengths]

    def step(self, forward, ids: torch.Tensor) -> torch.Tensor:
        """One decode step of every row: `forward(cache=..., **kwargs)` (the caller's, for `ids`)."""
        mask = self.step_mask()
        logits = forward(attention_mask=mask, position_ids=self.positions(), cache=self.cache)
        self.stepped(mask)
        return logits

    def join(self, other: BatchKV) -> BatchKV:
        """This batch's rows, then `other`'s, left-padded to the longer of the two."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        a, b = _padded(self, width), _padded(other, width)
        cache = _rebuilt(self.cache, lambda l: (torch.cat([a[0][l], b[0][l]]), torch.cat([a[1][l], b[1][l]])))
        return BatchKV(cache, torch.cat([a[2], b[2]]), self.lengths + other.lengths)

    def keep_rows(self, rows: list[int]) -> BatchKV | None:
        """Only `rows` (in this order), the padding all of them have cut; None when no row is left."""
        if not rows:
            return None
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        cut = int(mask.any(dim=0).nonzero()[0])  # the first column some row uses
        layers = self.cache.layers
        cache = _rebuilt(self.cache, lambda l: (layers[l].keys.index_select(0, idx)[:, :, cut:],
                                                layers[l].values.index_select(0, idx)[:, :, cut:]))
        return BatchKV(cache, mask[:, cut:], [self.lengths[i] for i in rows])


def _padded(kv: BatchKV, width: int) -> tuple[list, list, torch.Tensor]:
    """(keys per layer, values per layer, mask) of `kv` left-padded with zeros to `width` positions."""
    pad = width - kv.mask.shape[1]
    if pad == 0:
        return [l.keys for l in kv.cache.layers], [l.values for l in kv.cache.layers], kv.mask

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.new_zeros((*t.shape[:2], pad, t.shape[3])), t], dim=2)

    mask = torch.cat([kv.mask.new_zeros((kv.rows, pad)), kv.mask], dim=1)
    return [grow(l.keys) for l in kv.cache.layers], [grow(l.values) for l in kv.cache.layers], mask


def _rebuilt(template, keys_values):
    """A new cache of `template`'s class and layer kinds whose layer l holds `keys_values(l)`."""
    cache = type(template)()
    for l in range(len(template.layers)):
        k, v = keys_values(l)
        cache.update(k, v, l)
    return cache

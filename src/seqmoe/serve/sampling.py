"""Next-token choice and incremental text with stop sequences: the pure parts of `seqmoe serve`.

    gen = torch.Generator().manual_seed(seed)
    token = choose_token(logits, temperature=0.7, top_p=0.9, generator=gen)   # temperature 0: argmax
    text = TextStream(tokenizer, stop=("\\n\\n",))
    delta = text.push(token)          # text safe to send now ("" while a stop sequence may be starting)
    text.finished, text.text          # True once a stop sequence appeared; the text cut before it

Sampling draws from the request's own `torch.Generator`, so a seed gives the same tokens whatever
else the server ran before (the global RNG is never touched).
"""

from __future__ import annotations

import torch


def choose_token(logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token id.

    Args:
        logits: [V] float, the last position's logits.
        temperature: 0 picks the argmax (what `model.generate(do_sample=False)` picks); > 0 samples
            from softmax(logits / temperature).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability sums
            to at least top_p (the most likely token always stays); 1 keeps all.
        generator: the request's RNG (on logits' device); used only when temperature > 0.
    """
    logits = logits.float()
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass of the tokens ranked above each one
        sorted_p[before >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


class TextStream:
    """Decodes generated token ids into text and cuts it at the first stop sequence.

    `push` returns only text that can no longer change: it holds back an incomplete UTF-8
    character at the end (the tokenizer decodes it as U+FFFD) and any end of the text that could
    be the start of a stop sequence, so a streamed reply never shows part of a stop sequence.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""        # all the text so far (cut at the stop sequence once finished)
        self.sent = 0         # characters of `text` already returned by push/flush
        self.finished = False  # a stop sequence appeared

    def push(self, token_id: int) -> str:
        """Add one token; the newly safe text (may be empty)."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            self.text, self.finished = self.text[:cut], True
            return self._take(cut)
        return self._take(len(self.text) - self._held())

    def flush(self) -> str:
        """The rest of the text at the end of generation."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def _first_stop(self) -> int | None:
        # Only a stop sequence that ends in the unsent part is new; search from just before it.
        longest = max((len(s) for s in self.stop), default=0)
        lo = max(0, self.sent - longest)
        found = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held(self) -> int:
        """How many characters at the end of `text` to hold back."""
        t = self.text
        held = len(t) - len(t.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(t)), held, -1):
                if t.endswith(s[:k]):
                    held = k
                    break
        return held

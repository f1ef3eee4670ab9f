"""Token choice and stop sequences of `seqmoe serve` (src/seqmoe/serve/sampling.py), without a server.

Run: pytest tests/serve/test_sampling.py -q
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from seqmoe.serve.sampling import TextStream, choose_token  # noqa: E402


class CharTokenizer:
    """Token id i is chr(i); ids < 9 are special (skipped), like an EOS."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i >= 9 or not skip_special_tokens)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_temperature_zero_is_the_argmax_and_ignores_the_generator():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert choose_token(logits, temperature=0.0, top_p=0.5, generator=None) == 1


def test_sampling_is_reproducible_per_generator_and_follows_temperature():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    draw = lambda seed, t: [choose_token(logits, temperature=t, top_p=1.0,  # noqa: E731
                                         generator=g) for g in [torch.Generator().manual_seed(seed)] for _ in range(40)]
    assert draw(1, 1.0) == draw(1, 1.0)
    assert draw(1, 1.0) != draw(2, 1.0)
    assert set(draw(3, 1e-4)) == {int(logits.argmax())}  # a very low temperature is greedy


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    assert {choose_token(logits, temperature=1.0, top_p=0.7, generator=g) for _ in range(200)} == {0, 1}
    assert {choose_token(logits, temperature=1.0, top_p=0.01, generator=g) for _ in range(50)} == {0}


def stream(text: str, stop: tuple[str, ...]) -> tuple[list[str], TextStream]:
    s = TextStream(CharTokenizer(), stop)
    parts = []
    for i in ids(text):
        parts.append(s.push(i))
        if s.finished:
            break
    parts.append(s.flush())
    return parts, s


def test_stop_sequence_cuts_the_text_and_is_never_sent():
    parts, s = stream("hello world\n\nbye", ("\n\n", "zz"))
    assert s.finished and s.text == "hello world" and "".join(parts) == "hello world"
    assert not any("\n" in p for p in parts)


def test_a_possible_stop_start_is_held_back_then_released():
    s = TextStream(CharTokenizer(), ("abc",))
    assert [s.push(i) for i in ids("xab")] == ["x", "", ""]
    assert s.push(ord("d")) == "abd" and not s.finished
    assert s.flush() == ""


def test_without_stop_every_character_is_sent_once_and_specials_are_skipped():
    parts, s = stream("some text\x01 more", ())
    assert "".join(parts) == "some text more" == s.text and not s.finished


def test_an_incomplete_character_waits_for_its_bytes():
    class Bytes:  # ids are bytes of UTF-8
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    s = TextStream(Bytes())
    out = [s.push(b) for b in "é!".encode()]
    assert out == ["", "é", "!"]

"""Drafters (`seqmoe.brain.predict.drafters`) and the forecaster's look-ahead from their guesses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from seqmoe.base.errors import UserError
from seqmoe.brain.predict.buckets import trace_buckets
from seqmoe.brain.predict.drafters import NgramDrafter, TrueTokenDrafter, check_draft, make_drafter
from seqmoe.brain.predict.seqmodel import SeqConfig, SeqPredictor, gru_step
from seqmoe.trace.schema import RoutingTrace
from tests.conftest import make_trace

CFG = SeqConfig(num_layers=3, num_experts=8, top_k=2, hash_buckets=32, embed_dim=16, hidden_dim=12, query_dim=20)


def with_tokens(trace: RoutingTrace, pattern=(1, 2, 3, 4, 5, 2, 3, 6)) -> RoutingTrace:
    """Token ids repeating `pattern` (so n-grams recur), strings as the vocabulary."""
    ids = np.resize(np.array(pattern, dtype=np.int32), trace.num_tokens)
    return dataclasses.replace(trace, token_ids=ids, vocab=tuple(f"tok{i}" for i in range(10)))


def random_weights(seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in CFG.weight_shapes().items()}


class Fixed:
    """A drafter that always guesses `guesses` with confidences `conf`."""

    def __init__(self, guesses, conf) -> None:
        self.guesses, self.conf = list(guesses), list(conf)

    def begin_request(self) -> None:
        pass

    def see(self, t, token_id) -> None:
        pass

    def draft(self, n):
        return self.guesses[:n], self.conf[:n]


def test_ngram_guesses_what_followed_the_longest_recent_match():
    d = NgramDrafter()
    got = []
    for t, tok in enumerate([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]):
        d.see(t, tok)
        got.append(d.draft(3)[0])
    assert got[:4] == [[], [], [], []]
    assert got[4] == [2, 3, 4]  # "1" was followed by 2, 3, 4
    assert got[6] == [4, 1, 2]  # "1 2 3" -> 4
    assert got[7] == []  # "5" never seen
    assert got[10] == [5, 1, 2]  # the most recent "1 2 3" was followed by 5


def test_ngram_confidence_is_its_counted_hit_rate():
    d = NgramDrafter()
    before = d.hits / d.tries
    for t, tok in enumerate([7, 8, 7, 9, 7, 10, 7, 11]):  # "7" always guesses the wrong follower
        d.see(t, tok)
        d.draft(1)
    after = d.hits / d.tries
    assert after[0, 0] < before[0, 0]
    assert d.tries[0, 0] == d.tries[0, 1] + 3  # three depth-1 guesses of a one-token match were scored
    d.begin_request()  # forgets the request's tokens, keeps the counts
    d.see(0, 7)
    assert d.draft(1) == ([], []) and (d.hits / d.tries)[0, 0] == after[0, 0]
    d.see(1, None)  # an unknown token: nothing to match
    assert d.draft(1) == ([], [])


def test_ngram_fit_counts_a_trace():
    trace = with_tokens(make_trace(num_tokens=200, num_requests=2))
    d = NgramDrafter().fit(trace)
    assert d.tries.sum() > NgramDrafter().tries.sum() + 100
    assert (d.hits / d.tries)[2, 0] > 0.9  # a periodic text: three-token matches are right
    assert d.draft(1) == ([], [])  # starts afresh


def test_true_tokens_stop_at_the_request_end():
    trace = with_tokens(make_trace(num_tokens=60, num_requests=3))
    d = TrueTokenDrafter(trace)
    end = int(trace.request_offsets[1])
    d.see(end - 3, None)
    guesses, conf = d.draft(5)
    assert guesses == trace.token_ids[end - 2:end].tolist() and conf == [1.0, 1.0]
    blind = TrueTokenDrafter(make_trace(num_tokens=60))  # no token ids: nothing to draft
    blind.see(3, None)
    assert blind.draft(5) == ([], [])


def test_in_a_batched_replay_each_lanes_oracle_drafts_its_own_tokens_next():
    import copy

    trace = with_tokens(make_trace(num_tokens=60, num_requests=3))
    first = TrueTokenDrafter(trace)
    other = copy.deepcopy(first)  # a lane's: the same place
    assert other.place is first.place
    first.place.tokens = [4, 31]  # the step's trace tokens, rows 0 and 1
    for row, d in enumerate((first, other)):
        d.set_row(row)
        d.see(1, None)  # the step's index is not the lane's token
        t = first.place.tokens[row]
        assert d.draft(2)[0] == trace.token_ids[t + 1:t + 3].tolist()


def test_drafter_choices():
    assert make_drafter("none") is None
    assert isinstance(make_drafter("ngram"), NgramDrafter)
    with pytest.raises(UserError, match="ngram"):
        check_draft("bigram")


@pytest.mark.parametrize("window", [None, 0, 2])
def test_a_guess_of_no_confidence_changes_nothing(window):
    trace = with_tokens(make_trace(num_tokens=40, num_requests=1, num_experts=8, num_layers=3))
    w = random_weights()
    plain = SeqPredictor(CFG, w, window=window)
    drafted = SeqPredictor(CFG, w, window=window).use_drafter(Fixed([3, 4], [0.0, 0.0]))
    L = 3
    for p in (plain, drafted):
        p.check_trace(trace)
    for t in range(10):
        for p in (plain, drafted):
            p.begin_token(t * L, int(trace.token_ids[t]))
        a, b = plain.predict(t * L - 1), drafted.predict(t * L - 1)
        assert np.array_equal(a.probs, b.probs)
        for p in (plain, drafted):
            p.observe(t * L, trace.expert_ids[t, 0])


@pytest.mark.parametrize("conf", [1.0, 0.3])
def test_the_next_token_mixes_the_guessed_forecast_by_confidence(conf):
    """Rows of token t + 1 = conf x (query at t + 1 with the guessed bucket, after a GRU step on x_hat)
    + (1 - conf) x the undrafted rows; the compiled window path agrees with the reference."""
    trace = with_tokens(make_trace(num_tokens=20, num_requests=1))
    w, L = random_weights(1), 3
    plain = SeqPredictor(CFG, w)
    ref = SeqPredictor(CFG, w).use_drafter(Fixed([5], [conf]))
    fast = SeqPredictor(CFG, w, window=0).use_drafter(Fixed([5], [conf]))
    for p in (plain, ref, fast):
        p.check_trace(trace)
        p.begin_token(0, int(trace.token_ids[0]))
    base = plain.predict(-1).probs  # [2L, E]: token 0, then token 1
    x = base[:L].reshape(-1) @ w["route_in"] + w["tok_in"][int(trace_buckets(trace, 32)[0])]
    h = gru_step(w, w["h0"], x)
    b5 = int(ref._bucket(5))
    pre = w["q_h_w"] @ h + w["q_h_b"] + w["q_tok"][b5] + w["q_layer"][0]
    guessed = plain._rows(plain._query(pre), 0, L)
    want = np.concatenate([base[:L], conf * guessed + (1 - conf) * base[L:]])
    got_ref, got_fast = ref.predict(-1).probs, fast.predict(-1).probs
    assert np.abs(got_ref - want).max() < 1e-5
    assert np.abs(got_fast - want).max() < 1e-5
    assert not np.allclose(want, base)


def test_recursion_reads_the_guesses_further_out():
    trace = with_tokens(make_trace(num_tokens=30, num_requests=1))
    w, L = random_weights(2), 3
    plain = SeqPredictor(CFG, w)
    drafted = SeqPredictor(CFG, w).use_drafter(Fixed([5, 6, 7], [0.0, 0.0, 1.0]))
    for p in (plain, drafted):
        p.check_trace(trace)
        p.begin_token(0, int(trace.token_ids[0]))
        p.observe(0, trace.expert_ids[0, 0])
    a, b = plain.forecast(0, 6 * L), drafted.forecast(0, 6 * L)
    assert a.steps.tolist() == b.steps.tolist()
    upto = list(a.steps).index(3 * L)  # tokens 1 and 2 are guessed with no confidence: unchanged
    assert np.array_equal(a.probs[:upto], b.probs[:upto])
    assert not np.allclose(a.probs[upto:upto + L], b.probs[upto:upto + L])  # token 3 is guessed for sure

"""A prompt's positions replay into the state machine off the model thread, after its forward, so the
first token never waits for them; whatever reads the state machine next waits for the replay.
Time to first token is measured by `seqmoe bench-runtime --prompt-lengths` (not here).
Run: pytest tests/runtime/test_prefill.py -q
"""

from __future__ import annotations

import threading

import torch

from seqmoe.runtime.timing.decode import time_to_first_token
from seqmoe.runtime import offload
from tests.runtime.conftest import TEST_HW, fresh, greedy, reference


def test_the_prompt_replays_aside_and_the_next_reader_waits_for_it():
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "seqmoe", train=ref.train, hardware=TEST_HW)
    gate = threading.Event()
    reveal = rt.controller.driver.reveal

    def held(*a, **k):  # the replay thread waits until the prompt's forward has returned
        if threading.current_thread().name == "seqmoe-replay":
            gate.wait(10)
        return reveal(*a, **k)

    rt.controller.driver.reveal = held
    with torch.no_grad():
        model(torch.tensor([list(range(1, 40))]))  # returns while its 39 positions still wait to replay
    assert rt.controller._replaying is not None and rt.controller._replaying.is_alive()
    gate.set()
    s = rt.stats()  # settles: the replay has run
    assert s["tokens"] == 39 and s["activations"] == 39 * s["num_layers"] * s["top_k"]
    del rt.controller.driver.reveal
    assert torch.equal(greedy(model), ref.tokens)
    assert rt.trace().num_tokens == 39 + len(ref.tokens[0]) - 1
    rt.restore()


def test_time_to_first_token_leaves_the_runtime_settled():
    model = fresh("mixtral")
    rt = offload(model, 0.5, "on-demand-lru", train=reference("mixtral").train, hardware=TEST_HW)
    assert time_to_first_token(model, 64, repeats=2, runtime=rt) > 0
    assert rt.controller._replaying is None and rt.stats()["tokens"] == 128
    rt.restore()

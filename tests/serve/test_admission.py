"""Admission by forecast overlap in `seqmoe serve` (`--admission overlap`): the rule picks the waiting
request whose forecast routing overlaps most with the running batch and the resident experts, never
passes the head of the queue over more than MAX_SKIPS times in a row, leaves FIFO as it was, and
changes no request's tokens (only the order in which requests join).
Run: pytest tests/serve/test_admission.py -q
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.serve.admission import ADMISSIONS, CANDIDATES, MAX_SKIPS, Admission
from seqmoe.serve.batcher import GenParams, Job
from seqmoe.sim.lockstep import ADMISSIONS as SIM_ADMISSIONS
from tests.arch.collect.tiny_models import VOCAB, tiny_model


def _job(prompt) -> Job:
    return Job(prompt_ids=list(prompt), params=GenParams(max_tokens=1), emit=lambda *a: None)


@pytest.fixture(scope="module")
def model():
    return tiny_model("olmoe")


def _run(model, admission: Admission, prompt: list[int], lane: int) -> None:
    """`prompt`'s forward, observed as lane `lane`'s."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model(input_ids=ids)
    admission.observe(ids, [lane])


def _routing(model, prompt: list[int]) -> np.ndarray:
    """[N, L, K] the experts each position of `prompt` routes to (read by hooks of this test's own)."""
    from seqmoe.arch import moe_layers, unpack_router_output

    seen, layers = [], moe_layers(model)
    hooks = [m.router.register_forward_hook(lambda mod, a, out: seen.append(unpack_router_output(mod, out)[2]))
             for m in layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return torch.stack(seen, 1).numpy()


def test_the_names_are_the_simulators_and_a_bad_rule_is_a_user_error(model):
    assert ADMISSIONS is SIM_ADMISSIONS
    with pytest.raises(UserError, match="--admission must be one of fifo, overlap, got 'lifo'"):
        Admission("lifo", model, None, 4)


def test_overlap_picks_the_request_whose_forecast_shares_most_with_the_running_rows(model):
    adm = Admission("overlap", model, None, max_batch=4)
    try:
        running = [5, 17, 33, 60]
        _run(model, adm, running, lane=0)
        rng = np.random.default_rng(0)
        others = [rng.integers(3, VOCAB, 6).tolist() for _ in range(5)]
        for i, p in enumerate(others):
            _run(model, adm, p, lane=1 + i)  # their tokens' routing is known too
        waiting = [_job(p) for p in others] + [_job([running[-1]] * 3)]  # forecasts the running row's routing exactly
        # naive reference: per candidate, the mean over its tokens of (layer, expert) pairs in the running row's set
        last = _routing(model, running)[-1]  # [L, K] the running row's latest position
        table = {}
        for p in [running, *others]:
            for t, r in zip(p, _routing(model, p)):
                table[t] = r
        want = [np.mean([sum(len(set(table[t][l]) & set(last[l])) for l in range(len(last))) for t in j.prompt_ids])
                for j in waiting]
        got = adm.pick(waiting, [0])
        assert got == int(np.argmax(want))
        assert want[-1] == last.size and (got == len(waiting) - 1 or want[got] == last.size)
        assert adm.pick(waiting, []) == 0  # an empty batch: FIFO
        unknown = next(t for t in range(VOCAB) if t not in table)
        assert adm.forecast([unknown]).sum() == 0 and adm.forecast([unknown, running[-1]]).sum() == last.size
    finally:
        adm.close()


def test_the_head_is_passed_over_at_most_max_skips_times_in_a_row(model):
    adm = Admission("overlap", model, None, max_batch=4)
    try:
        _run(model, adm, [7, 8, 9], lane=0)
        fresh = iter(range(10, VOCAB))  # tokens of no known routing: forecast 0, never preferred
        queue = [_job([next(fresh)])] + [_job([9]) for _ in range(CANDIDATES)]
        runs, run, head = [], 0, queue[0]
        for _ in range(3 * (MAX_SKIPS + 1)):
            i = adm.pick(queue, [0])
            run = 0 if i == 0 else run + 1
            runs.append(run)
            queue.pop(i)
            if i == 0:
                queue.insert(0, _job([next(fresh)]))  # another unknown request at the head
            queue.append(_job([9]))
        assert head not in queue and max(runs) == MAX_SKIPS  # the bound is reached, never passed
        assert adm.reordered == sum(r > 0 for r in runs)
    finally:
        adm.close()


def test_fifo_takes_the_head_and_hooks_nothing(model):
    adm = Admission("fifo", model, None, max_batch=4)
    _run(model, adm, [7, 8, 9], lane=0)
    assert not adm._hooks and adm.pick([_job([1]), _job([9])], [0]) == 0 and adm.reordered == 0


@pytest.fixture(scope="module")
def served():
    """One batcher on seqmoe-tiny (r = 0.3, CPU, batches of 2); the tests swap its admission rule."""
    from seqmoe.config import LoadConfig, OffloadConfig
    from seqmoe.serve.startup import start_batcher

    s = start_batcher(LoadConfig(model="seqmoe-tiny", threads=1),
                    OffloadConfig(residency=0.3, system="on-demand-lru", device="cpu"), max_batch=2)
    yield s
    s.close()


def _serve(served, prompts: list[list[int]], rule: str):
    """Each prompt's greedy text under admission `rule`, every job waiting before the first is admitted;
    (texts, the order they were admitted in, the batcher's counts)."""
    batcher = served.batcher
    batcher.call(batcher.admission.close).result()
    batcher.admission = adm = Admission(rule, batcher.model, served.runtime, batcher.max_batch)
    texts = [[] for _ in prompts]
    done = threading.Semaphore(0)
    order: list[int] = []

    def emit(i):
        def on(kind, *args):
            if kind == "text":
                texts[i].append(args[0])
            else:
                done.release()
        return on

    jobs = [Job(prompt_ids=p, params=GenParams(max_tokens=8), emit=emit(i)) for i, p in enumerate(prompts)]
    pick = adm.pick
    adm.pick = lambda waiting, lanes: order.append(jobs.index(waiting[(c := pick(waiting, lanes))])) or c
    gate = threading.Event()
    batcher.call(gate.wait)  # the batcher waits until every job is queued
    for j in jobs:
        batcher.submit(j)
    gate.set()
    for _ in jobs:
        assert done.acquire(timeout=120)
    return ["".join(t) for t in texts], order, batcher.counts()


def test_overlap_reorders_admission_and_every_request_keeps_its_greedy_text(served):
    texts = ["def parse(", "The river", "import os\n", "Once upon a time", "def add(a, b):", "The mountain",
             "import sys\n", "def parse(x"]
    prompts = [served.tokenizer(t)["input_ids"] for t in texts]
    over, over_order, over_counts = _serve(served, prompts, "overlap")
    fifo, fifo_order, fifo_counts = _serve(served, prompts, "fifo")
    assert fifo_order == list(range(len(prompts))) and fifo_counts["reordered"] == 0
    assert sorted(over_order) == list(range(len(prompts))) and over_counts["reordered"] == sum(
        1 for i, r in enumerate(over_order) if r != min(over_order[i:]))
    assert over_order != fifo_order  # the rule did reorder here
    run = 0
    for i, r in enumerate(over_order):  # admissions in a row that passed the head (the oldest waiting) over
        run = 0 if r == min(over_order[i:]) else run + 1
        assert run <= MAX_SKIPS
    assert over == fifo and all(over)  # the same tokens for every request
    assert over_counts["admission"] == "overlap" and over_counts["max_wait_s"] >= over_counts["mean_wait_s"] > 0


def test_a_bad_admission_flag_is_a_one_line_error(capsys):
    from seqmoe.cli import main

    assert main(["serve", "--model", "seqmoe-tiny", "--admission", "lifo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == "seqmoe: error: --admission must be one of fifo, overlap, got 'lifo'"

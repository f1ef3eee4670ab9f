"""An interrupted generate (Ctrl-C, or any error mid-forward) leaves the runtime usable at once, with
the full model's tokens; teardown completes under a second Ctrl-C; a dropped runtime frees its threads.

Run: pytest tests/runtime/test_interrupts.py -q
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from seqmoe.runtime import offload
from seqmoe.runtime.core.experts import OffloadedExperts
from tests.runtime.conftest import PROMPT, fresh, greedy, reference

REPO = Path(__file__).resolve().parents[2]


class _Once:
    """Raise KeyboardInterrupt at the n-th call (as a Ctrl-C landing there would)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, *args, **kwargs):
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt


def _interrupt_at(where: str, rt, model, n: int):
    """Arrange a KeyboardInterrupt at the n-th passage through `where`; a callable that undoes it."""
    if where == "router":  # inside a forward, in a hook after the runtime's router hook (posted, or routed)
        h = rt._layers[1].router.register_forward_hook(lambda *a, _f=_Once(n): _f())
        return h.remove
    if where == "experts":  # inside the experts forward of the last layer
        h = rt._layers[-1].experts.register_forward_pre_hook(lambda *a, _f=_Once(n): _f())
        return h.remove
    if where == "replay":  # while a prompt's positions replay into the state machine (aside, after its forward):
        driver, orig, fire = rt.controller.driver, rt.controller.driver.reveal, _Once(n)  # raised by the next forward

        def reveal(*a, **k):
            if threading.current_thread().name == "seqmoe-replay":
                fire()
            return orig(*a, **k)

        driver.reveal = reveal
        return lambda: driver.__dict__.pop("reveal")
    raise ValueError(where)


@pytest.mark.parametrize("where", ["router", "experts", "replay"])
@pytest.mark.parametrize("control", ["inline", "thread"])
def test_an_interrupted_generate_leaves_the_runtime_usable(control, where):
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, control=control)
    greedy(model)
    undo = _interrupt_at(where, rt, model, n=4 if where != "replay" else 3)
    with pytest.raises(KeyboardInterrupt):
        greedy(model, prompt=[1, *range(30, 50)], new_tokens=30)
    undo()
    t0 = time.perf_counter()
    assert torch.equal(greedy(model), ref.tokens)
    assert time.perf_counter() - t0 < 5  # not the catch-up timeout
    s = rt.stats()
    # The interrupted token is dropped, unless a posting step had posted all its layers already.
    assert s["abandoned_tokens"] == (0 if (control, where) == ("thread", "experts") else 1)
    trace = rt.trace()
    assert trace.num_tokens == s["tokens"] - s["abandoned_tokens"]  # every finished position is traced
    assert s["activations"] >= trace.num_tokens * s["num_layers"] * s["top_k"]
    if control == "thread":
        thread = rt.controller.thread
        assert thread.done == thread.launched and thread._thread.is_alive()
    _assert_pool_matches_the_state_machine(rt)
    rt.restore()
    assert torch.equal(greedy(model), ref.tokens)


def _assert_pool_matches_the_state_machine(rt) -> None:
    rt.synchronize()
    assert rt.pool.resident() == set(np.flatnonzero(rt.controller.state.present_mask()).tolist())
    assert len(rt.pool.slot_of) + len(rt.pool.free) == rt.capacity  # no slot lost


def test_a_sigint_inside_a_decision_waits_for_its_end():
    """A real SIGINT in the middle of the memory manager's decision (inline routing) is raised once the
    decision is complete: slots and state machine still agree. (A prompt's replay and, with thread
    control, every decode decision run on threads of their own, where no SIGINT lands.)"""
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.2, "on-demand-lru", control="inline")  # empty start pool: decisions load and evict
    greedy(model)
    ctrl, calls = rt.controller, [0]
    on_load = ctrl.on_load

    def on_load_with_sigint(*args):  # the manager took the slot; the pool has not heard of it yet
        if threading.current_thread() is threading.main_thread():  # the control thread may still be catching up
            calls[0] += 1
            if calls[0] == 3:
                signal.raise_signal(signal.SIGINT)  # without the shield, KeyboardInterrupt comes right here
        return on_load(*args)

    ctrl.on_load = on_load_with_sigint
    with pytest.raises(KeyboardInterrupt):
        greedy(model, prompt=[1, *range(30, 50)], new_tokens=30)
    del ctrl.on_load
    assert calls[0] >= 3
    assert torch.equal(greedy(model), ref.tokens)
    _assert_pool_matches_the_state_machine(rt)
    rt.restore()


def test_an_interrupted_decode_graph_generate_leaves_the_runtime_usable():
    from seqmoe.runtime import DecodeGraph

    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, control="thread")
    dg = DecodeGraph(rt, 64)
    undo = _interrupt_at("router", rt, model, n=5)  # the 4th decode step, after its layer 1 posted
    with pytest.raises(KeyboardInterrupt):
        dg.generate(torch.tensor([PROMPT]), 20)
    undo()
    t0 = time.perf_counter()
    assert torch.equal(dg.generate(torch.tensor([PROMPT]), 8), ref.tokens)
    assert time.perf_counter() - t0 < 5 and rt.stats()["abandoned_tokens"] == 1
    rt.restore()


@pytest.mark.parametrize("control", ["inline", "thread"])
def test_a_real_sigint_during_generate(control):
    """SIGINT from outside at random moments; each time the next generate returns at once, exact."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.runtime.sigint_child", control, "4"], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rng = random.Random(0)
    rows = []
    watchdog = threading.Timer(120, proc.kill)  # a hang fails the test (the child also dumps its stacks)
    watchdog.start()
    try:
        for line in proc.stdout:
            if line.strip() == "go":
                time.sleep(rng.uniform(0.05, 0.4))
                proc.send_signal(signal.SIGINT)
            elif line.startswith("{"):
                rows.append(json.loads(line))
        proc.wait(60)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    rounds, end = rows[:-1], rows[-1]
    assert len(rounds) == 4 and end == {"restored": True}
    for r in rounds:
        assert r["equal"] and r["seconds"] < 5, r
        assert r["idle_cpu_s"] < 0.1, r  # no thread left spinning on a step that never comes


def test_a_second_ctrl_c_during_restore_still_restores_everything():
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, control="thread")
    greedy(model)
    layout = rt._layouts[0]

    class SigintMidRestore:  # the first layer's weights come back, then Ctrl-C arrives
        def __getattr__(self, name):
            return getattr(layout, name)

        def unpack(self, *args):
            layout.unpack(*args)
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.01)  # the handler runs here

    rt._layouts[0] = SigintMidRestore()
    with pytest.raises(KeyboardInterrupt):
        rt.restore()
    assert rt._restored and rt.closed
    assert not any(isinstance(m.experts, OffloadedExperts) for m in rt._layers)
    assert not model._forward_hooks and not model._forward_pre_hooks and "forward" not in model.__dict__
    assert not any(m.router._forward_hooks for m in rt._layers)
    assert not rt.controller.thread._thread.is_alive() and not rt.worker._thread.is_alive()
    assert torch.equal(greedy(model), ref.tokens)


def test_a_dropped_runtime_and_model_free_their_threads_and_pool():
    model = fresh("olmoe")
    rt = offload(model, 0.5, control="thread")
    greedy(model)
    threads = [weakref.ref(rt.controller.thread._thread), weakref.ref(rt.worker._thread)]
    pool = weakref.ref(rt.pool.pool)
    del rt
    gc.collect()
    assert all(t() is not None and t().is_alive() for t in threads)  # the model still uses its runtime
    assert torch.equal(greedy(model), reference("olmoe").tokens)
    del model
    gc.collect()  # the finalizer stops the threads...
    assert all(t() is None or not t().is_alive() for t in threads)
    gc.collect()  # ...which held the rest, freed in the next pass
    assert pool() is None


def test_stats_from_another_thread_while_generating():
    """stats() only reads: polling it from another thread neither fails nor disturbs the run."""
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, control="thread")
    stop, errors, polls = threading.Event(), [], [0]

    def poll():
        while not stop.is_set():
            try:
                rt.stats()
                polls[0] += 1
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

    t = threading.Thread(target=poll)
    t.start()
    try:
        outs = [greedy(model) for _ in range(3)]
    finally:
        stop.set()
        t.join()
    assert not errors and polls[0] > 0
    assert all(torch.equal(o, ref.tokens) for o in outs)
    assert rt.trace().num_tokens == 3 * (len(PROMPT) + 7)
    rt.restore()


def test_a_forward_from_a_second_thread_is_refused_without_disturbing_the_first():
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train)
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold(*args):  # the main thread's forward pauses in its first MoE layer
        if not inside.is_set():
            inside.set()
            release.wait(10)

    h = rt._layers[0].router.register_forward_hook(hold)

    def other():
        inside.wait(10)
        try:
            model(torch.tensor([[1, 2, 3]]))
        except RuntimeError as e:
            errors.append(str(e))
        release.set()

    t = threading.Thread(target=other)
    t.start()
    out = greedy(model)
    t.join()
    h.remove()
    assert errors and "another thread's forward runs" in errors[0]
    assert torch.equal(out, ref.tokens) and rt.trace().num_tokens == len(PROMPT) + 7
    rt.restore()

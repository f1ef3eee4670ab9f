"""The slot fence holds without any assumption on timing: a CPU stress test whose device reads take
long and whose acknowledgements reach the host late finds no stale read; with the fence removed, the
same detector fires. On CUDA (skipped without it): long prompts, large experts and a second
request give the full model's tokens.

Run: pytest tests/runtime/test_fence.py -q        (pool.py's docstring holds the argument)
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque

import pytest
import torch

from seqmoe.runtime.core.copier import CopyWorker
from seqmoe.runtime.posted.fence import ReadFence
from seqmoe.runtime.posted.mailbox import Mailbox
from seqmoe.runtime.core.pool import ExpertPool

L, E, P, C = 2, 6, 64, 4
CPU = torch.device("cpu")


def _lagged(read, lag_s: float):
    """`read()` as a host that sees device writes `lag_s` late: the newest value sampled that long ago."""
    samples: deque[tuple[float, int]] = deque()
    seen = [read()]

    def view() -> int:
        now = time.perf_counter()
        samples.append((now, read()))
        while samples and samples[0][0] <= now - lag_s:
            seen[0] = samples.popleft()[1]
        return seen[0]

    return view


def stress(seconds: float, lag_s: float, fence_on: bool = True, seed: int = 0) -> tuple[int, int, int]:
    """(reads checked, reads whose entry was released while in flight, stale reads) of a device
    thread reading slots while a control thread churns them.

    The device thread runs forwards of L layers: each layer posts (the mailbox's acknowledgement and
    snapshot), resolves one routed expert's slot from the table, holds the read in flight for up to
    2 ms, then reads the slot and checks it still holds that expert (rows are filled with the uid).
    The control thread releases and reassigns slots at random; the copy worker refills them; the
    host sees the device's acknowledgements and forward completions `lag_s` late."""
    hosts = [torch.arange(l * E, (l + 1) * E, dtype=torch.float32).repeat_interleave(P).view(E, P) for l in range(L)]
    fence = ReadFence(CPU)
    pool = ExpertPool(hosts, C, CPU, fence=fence)
    box = Mailbox(L, 1, CPU, fence)
    fence.acked = _lagged(fence.acked, lag_s)  # instance attributes: the host's late view of device progress
    completed = fence.completed
    fence.completed = _lagged(completed, lag_s)
    if not fence_on:
        pool._await_readers = lambda *a: True  # the mutant: refill at once
    for uid in range(C):
        pool.load_now(uid)
    worker = CopyWorker(pool)
    stop, counts, rng = threading.Event(), [0, 0, 0], random.Random(seed)

    def device() -> None:
        r = random.Random(seed + 1)
        while not stop.is_set():
            seq = fence.begin()
            for layer in range(L):
                e = r.randrange(E)
                box.post(layer, torch.tensor([[e]]), torch.ones(1, 1), torch.tensor([0]) if layer == 0 else None)
                slot = int(pool.table[layer, e])  # the device resolves the entry...
                if slot < 0:
                    continue
                time.sleep(r.uniform(0, 2e-3))  # ...and its read of the slot is still in flight
                counts[0] += 1
                counts[1] += int(pool.table[layer, e]) != slot  # released meanwhile: the fence must hold the slot
                counts[2] += not bool((pool.pool[slot] == layer * E + e).all())
            fence.end(seq)

    def control() -> None:
        while not stop.is_set():
            resident = list(pool.slot_of)
            uid = rng.choice(resident)
            pool.release(uid)
            new = rng.choice([u for u in range(L * E) if u not in pool.slot_of])
            slot, gen = pool.assign(new)
            worker.submit(new, slot, gen, True, 0)
            time.sleep(rng.uniform(0, 1e-3))

    threads = [threading.Thread(target=device), threading.Thread(target=control)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not (not fence_on and counts[2]):
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join()
    worker.close()
    return counts[0], counts[1], counts[2]


@pytest.mark.parametrize("lag_s", [0.0, 0.005])
def test_no_stale_read_when_device_progress_reaches_the_host_late(lag_s):
    reads, contended, stale = stress(2.0, lag_s)
    assert reads > 100 and contended > 10  # slots were released under in-flight reads...
    assert stale == 0  # ...and none was overwritten before the read finished


def test_the_stress_detector_fires_without_the_fence():
    """The mutant check: the same run with refills at once reads stale slots (so the test above can fail)."""
    reads, contended, stale = stress(5.0, 0.005, fence_on=False)
    assert stale > 0


# -- on a GPU ---------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _big_olmoe():
    """An OLMoE with 48 MiB experts (fp32, hidden 1024, intermediate 4096): copies take milliseconds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("olmoe", vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=3,
                                  num_attention_heads=8, num_key_value_heads=8, num_experts=8, num_experts_per_tok=2,
                                  max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("Router"):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.05)
    return model


def _requests():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 512, (1, 1500), generator=g), torch.randint(3, 512, (1, 1200), generator=g)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("engine", ["generate", "graph"])
def test_long_prompts_large_experts_and_a_second_request_on_cuda(engine):
    """Point 3 and 4 of issue 11: the prompt's replay refills slots while its last layers may still
    read them (from the second request on, once the pool is full), and decode-step releases are
    fenced by acknowledgements: the tokens must be the full model's."""
    import copy

    from seqmoe.runtime import DecodeGraph, offload

    base = _big_olmoe()
    full = copy.deepcopy(base).to("cuda")
    reqs = [r.cuda() for r in _requests()]
    want = [full.generate(r, max_new_tokens=24, do_sample=False, pad_token_id=0) for r in reqs]
    del full
    rt = offload(base, 0.25, "on-demand-lru", device="cuda")  # 6 of 24 experts in slots: the pool fills up
    assert rt.control == "thread"
    dg = DecodeGraph(rt, 1600) if engine == "graph" else None
    for r, w in zip(reqs, want):
        got = dg.generate(r, 24) if dg is not None else base.generate(r, max_new_tokens=24, do_sample=False,
                                                                      pad_token_id=0)
        assert torch.equal(got, w)
    s = rt.stats()
    assert s["copies"] > 0 and s["host_reads"] > 0 and rt.pool.fence.acked() > 0
    rt.synchronize()  # every queued copy ran: each fence wait ended although no step acknowledges any more
    c0 = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - c0 < 0.1  # and nothing spins
    rt.restore()


@pytest.mark.gpu
@cuda
def test_the_fence_acknowledgement_round_trips_on_cuda():
    """The Triton post acknowledges the previous snapshot and snapshots the version, as the torch ops do."""
    fence = ReadFence(torch.device("cuda"))
    box = Mailbox(2, 2, torch.device("cuda"), fence)
    fence.publish(5)
    ids, w = torch.tensor([[1, 0]], device="cuda"), torch.tensor([[0.5, 0.5]], device="cuda")
    box.post(0, ids, w, torch.tensor([3], device="cuda"))
    torch.cuda.synchronize()
    assert fence.acked() == 0 and int(fence.snap) == 5
    fence.publish(9)
    box.post(1, ids, w, None)
    torch.cuda.synchronize()
    assert fence.acked() == 5 and int(fence.snap) == 9

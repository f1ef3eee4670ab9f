"""The thread-mode engine's parts: mailbox, slot fence, device-side gather, and the decode step that
reads no host value (`DecodeGraph`, run eagerly on the CPU; captured as a CUDA graph on a GPU).

Exactness and simulator fidelity of `control="thread"` are in test_exact.py, test_fidelity.py and
test_forecaster.py (parametrised over both engines). Run: pytest tests/runtime/test_thread.py -q
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.runtime import offload
from seqmoe.runtime.posted.graph import DecodeGraph
from seqmoe.runtime.posted.mailbox import Mailbox
from seqmoe.runtime.core.mapped import gather_rows
from seqmoe.runtime.posted.fence import ReadFence
from seqmoe.runtime.core.pool import ExpertPool
from tests.arch.collect.tiny_models import ARCHS
from tests.runtime.conftest import PROMPT, TEST_HW, fresh, greedy, reference, run_interpreted

HOST_READS = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"]


def test_mailbox_round_trip_in_ring_order():
    box = Mailbox(num_layers=3, top_k=2, device=torch.device("cpu"), ring=4)
    for step in range(6):  # laps the ring once
        for layer in range(3):
            box.post(layer, torch.tensor([[step, layer]]), torch.tensor([[0.25, 0.75]]),
                     torch.tensor([100 + step]) if layer == 0 else None)
            ids, w, tok = box.wait(step, layer)
            assert ids.tolist() == [[step, layer]] and w.tolist() == [[0.25, 0.75]]
            assert tok == ([100 + step] if layer == 0 else None)
    assert int(box.posts) == 18
    with pytest.raises(RuntimeError, match="overwritten"):
        box.wait(1, 0)  # step 1 sat where step 5 now is
    box.post(0, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0.5, 0.5], [0.25, 0.75]]), torch.tensor([7, 8]))
    ids, w, tok = box.wait(6, 0, rows=2)  # a step of two rows: each row's routing and token
    assert ids.tolist() == [[1, 2], [3, 4]] and w.tolist() == [[0.5, 0.5], [0.25, 0.75]] and tok == [7, 8]
    with pytest.raises(UserError, match="2 rows at most"):
        Mailbox(num_layers=3, top_k=2, device=torch.device("cpu"), rows=2).post(0, torch.zeros((3, 2)), torch.zeros((3, 2)), None)


def test_mailbox_wait_blocks_until_the_post():
    box = Mailbox(num_layers=1, top_k=1, device=torch.device("cpu"))
    got = []
    t = threading.Thread(target=lambda: got.append(box.wait(0, 0)))
    t.start()
    time.sleep(0.05)
    assert not got
    box.post(0, torch.tensor([[3]]), torch.tensor([[1.0]]), torch.tensor([7]))
    t.join(5)
    assert got and got[0][0].tolist() == [[3]] and got[0][2] == [7]


def test_gather_rows_takes_the_slot_or_the_host_row_and_counts_reads():
    pool = torch.arange(12.0).view(3, 4)
    host = -torch.arange(20.0).view(5, 4)
    table = torch.tensor([0, 2, -1, -1, 1], dtype=torch.int32)  # expert -> slot
    reads = torch.zeros(2, dtype=torch.int64)
    out = gather_rows(pool, host, table, torch.tensor([4, 3, 0]), torch.empty(3, 4), reads)
    assert torch.equal(out, torch.stack([pool[1], host[3], pool[0]]))
    assert reads.tolist() == [2, 1]


def _fill_in_thread(pool, uid):
    slot, gen = pool.assign(uid)
    done = threading.Event()
    threading.Thread(target=lambda: (pool.fill(uid, slot, gen), done.set()), daemon=True).start()
    return slot, done


def test_a_released_slot_is_refilled_once_the_device_acknowledges_the_clearing_version():
    hosts = [torch.arange(8.0).view(2, 4)]
    fence = ReadFence(torch.device("cpu"))
    pool = ExpertPool(hosts, capacity=1, device=torch.device("cpu"), fence=fence)
    box = Mailbox(num_layers=1, top_k=1, device=torch.device("cpu"), fence=fence)
    pool.load_now(0)
    seq = fence.begin()  # a forward that may still read slot 0 for expert 0
    box.post(0, torch.tensor([[0]]), torch.tensor([[1.0]]), torch.tensor([1]))  # its snapshot: before the release
    pool.release(0)
    slot, done = _fill_in_thread(pool, 1)
    # The next post acknowledges the old snapshot (the reads after it may still use expert 0's entry)
    # and snapshots the clearing version; the one after acknowledges that.
    box.post(0, torch.tensor([[0]]), torch.tensor([[1.0]]), torch.tensor([1]))
    assert not done.wait(0.1)  # the device may still read the slot for expert 0
    assert pool.table_host[0, 1] == -1 and torch.equal(pool.pool[slot], hosts[0][0])
    box.post(0, torch.tensor([[0]]), torch.tensor([[1.0]]), torch.tensor([1]))
    assert done.wait(5)
    assert pool.table_host[0, 1] == slot and torch.equal(pool.pool[slot], hosts[0][1])
    fence.end(seq)


def test_a_released_slot_is_refilled_once_every_earlier_forward_completed():
    hosts = [torch.arange(8.0).view(2, 4)]
    fence = ReadFence(torch.device("cpu"))
    pool = ExpertPool(hosts, capacity=1, device=torch.device("cpu"), fence=fence)
    pool.load_now(0)
    seq = fence.begin()
    pool.release(0)
    later = fence.begin()  # begun after the release: it reads the cleared entry, nobody waits for it
    slot, done = _fill_in_thread(pool, 1)
    assert not done.wait(0.1)
    fence.end(seq)  # nothing acknowledged, but the forward that may read the slot is over (decoding stopped)
    assert done.wait(5) and pool.table_host[0, 1] == slot
    fence.end(later)
    pool.release(1)  # no forward runs: refillable at once
    assert pool.fill(0, *pool.assign(0))


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_graph_eager_generates_like_the_full_model(arch):
    ref = reference(arch)
    model = fresh(arch)
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, hardware=TEST_HW, control="thread")
    dg = DecodeGraph(rt, max_length=32)
    assert not dg.capture  # CPU: the same step, run eagerly
    out = dg.generate(torch.tensor([PROMPT]), 8)
    assert torch.equal(out, ref.tokens)
    trace = rt.trace()
    assert trace.num_tokens == len(PROMPT) + 7 and trace.token_ids.tolist() == out[0, :-1].tolist()
    s = rt.stats()
    assert s["pool_reads"] + s["host_reads"] >= 7 * s["num_layers"] * s["top_k"]
    rt.restore()


def test_decode_graph_of_a_plain_model_is_the_full_load_baseline():
    ref = reference("qwen3_moe")
    assert torch.equal(DecodeGraph(fresh("qwen3_moe"), 32).generate(torch.tensor([PROMPT]), 8), ref.tokens)


@pytest.mark.parametrize("check_every", [1, 3, 16])
def test_decode_graph_stops_at_eos_like_generate(check_every):
    ref = reference("gpt_oss")
    eos = int(ref.tokens[0, len(PROMPT) + 3])  # a token greedy decoding produces 4 steps in
    want = ref.model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                              eos_token_id=eos)
    assert want.shape[1] < ref.tokens.shape[1]
    model = fresh("gpt_oss")
    rt = offload(model, 0.5, "on-demand-lru", train=ref.train, control="thread")
    got = DecodeGraph(rt, 32).generate(torch.tensor([PROMPT]), 8, eos_token_id=eos, check_every=check_every)
    assert torch.equal(got, want)
    rt.restore()


def test_decode_graph_trace_and_counts_equal_the_inline_engine():
    ref = reference("olmoe")
    runs = []
    for control in ("inline", "thread"):
        model = fresh("olmoe")
        rt = offload(model, 0.3, "affinity-style", train=ref.train, hardware=TEST_HW, control=control)
        out = DecodeGraph(rt, 32).generate(torch.tensor([PROMPT]), 8) if control == "thread" else greedy(model)
        s = rt.stats()
        runs.append((out, rt.trace().expert_ids, (s["ready"], s["late"], s["misses"], s["prefetches"])))
        rt.restore()
    (o1, ids1, c1), (o2, ids2, c2) = runs
    assert torch.equal(o1, o2) and np.array_equal(ids1, ids2) and c1 == c2


def test_the_decode_step_reads_no_host_value(monkeypatch):
    """What the graph captures: no Python-level read of a tensor's value anywhere in the step."""
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, hardware=TEST_HW, control="thread")
    dg = DecodeGraph(rt, 32)
    dg.generate(torch.tensor([PROMPT]), 2)
    reads = []
    ctrl = rt.controller
    ctrl.begin_posted(None)  # what DecodeGraph does around each replay
    ctrl.graph_step = True
    for name in HOST_READS:
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _o=orig, **k: (reads.append(_n), _o(self, *a, **k))[1])
    with torch.no_grad():
        dg._step()
    monkeypatch.undo()
    ctrl.graph_step = False
    assert reads == []
    ctrl.end_posted()
    assert rt.trace().num_tokens == len(PROMPT) + 2  # the step was posted and read by the control thread
    rt.restore()


def test_decode_graph_rejects_the_inline_engine_and_overlong_requests():
    model = fresh("olmoe")
    rt = offload(model, 0.5, control="inline")
    with pytest.raises(UserError, match="control='thread'"):
        DecodeGraph(rt, 16)
    rt.restore()
    rt = offload(model, 0.5, control="thread")
    with pytest.raises(UserError, match="do not fit"):
        DecodeGraph(rt, 8).generate(torch.tensor([PROMPT]), 8)
    with pytest.raises(UserError, match="control must be"):
        offload(fresh("olmoe"), 0.5, control="async")
    rt.restore()


def test_triton_kernels_equal_the_torch_ops_under_the_interpreter():
    run_interpreted("tests.runtime.triton_interp_check")


# -- on a GPU ---------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_mapped_view_and_triton_gather_on_cuda():
    from seqmoe.runtime.core.mapped import device_view

    host = torch.randn(6, 1000, pin_memory=True)
    view = device_view(host, torch.device("cuda"))
    assert view.device.type == "cuda" and view.data_ptr() == host.data_ptr()
    view[2].mul_(2.0)  # a device write lands in host memory
    torch.cuda.synchronize()
    pool = torch.randn(3, 1000, device="cuda")
    table = device_view(torch.tensor([1, -1, -1, 0, -1, -1], dtype=torch.int32, pin_memory=True), torch.device("cuda"))
    ids = torch.tensor([0, 2, 5, 3], device="cuda")
    reads = torch.zeros(2, dtype=torch.int64, device="cuda")
    out = gather_rows(pool, view, table, ids, torch.empty(4, 1000, device="cuda"), reads)
    want = torch.stack([pool[1], host[2].cuda(), host[5].cuda(), pool[0]])
    assert torch.equal(out, want) and reads.tolist() == [2, 2]


@pytest.mark.gpu
@cuda
def test_triton_post_equals_the_torch_ops_on_cuda():
    from seqmoe.runtime.kernels import mapped

    boxes = []
    kernels = mapped.kernels()
    assert kernels is not None  # CUDA torch ships triton
    for triton_on in (True, False):
        fence = ReadFence(torch.device("cuda"))
        box = Mailbox(num_layers=2, top_k=3, device=torch.device("cuda"), fence=fence, ring=4)
        mapped._KERNELS = kernels if triton_on else None
        mapped._TRIED = True
        try:
            for step in range(5):
                for layer in range(2):
                    fence.publish(10 * step + layer)
                    box.post(layer, torch.tensor([[step, layer, 7]], device="cuda"),
                             torch.tensor([[0.5, 0.25, 0.25]], device="cuda", dtype=torch.bfloat16),
                             torch.tensor([40 + step], device="cuda") if layer == 0 else None)
                    torch.cuda.synchronize()  # the post runs before the host publishes the next version
        finally:
            mapped._KERNELS = kernels
        torch.cuda.synchronize()
        boxes.append(box)
        assert box.wait(4, 1)[0].tolist() == [[4, 1, 7]] and box.wait(4, 0)[2] == [44] and int(box.posts) == 10
        assert fence.acked() == 40 and int(fence.snap) == 41  # the previous post's snapshot, then its own
    a, b = boxes
    for x in ("ids_np", "weights_np", "tokens_np", "seq_np"):
        assert np.array_equal(getattr(a, x), getattr(b, x)), x


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("system", ["on-demand-lru", "affinity-style"])
def test_captured_decode_step_generates_like_the_full_model_on_cuda(system, impl):
    import copy

    ref = reference("olmoe")
    full = copy.deepcopy(ref.model).to("cuda")
    full.config._experts_implementation = impl
    ids = torch.tensor([PROMPT], device="cuda")
    want = full.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    if impl == "batched_mm":  # the full model's own captured step (grouped_mm fp32 cannot be captured)
        assert torch.equal(DecodeGraph(full, 64).generate(ids, 16), want)
    model = fresh("olmoe")
    model.config._experts_implementation = impl
    rt = offload(model, 0.2, system, train=ref.train, device="cuda")
    assert rt.control == "thread" and rt.pool.hosts[0].is_pinned()
    dg = DecodeGraph(rt, 64)
    got = dg.generate(ids, 16)
    assert dg.graph is not None
    assert torch.equal(got, want)
    got2 = dg.generate(ids, 16)  # replays the same graph for a second request
    assert torch.equal(got2, want)
    s = rt.stats()
    assert s["tokens"] == 2 * (len(PROMPT) + 15) and s["host_reads"] > 0 and s["pool_reads"] > 0
    assert s["device_expert_bytes"] <= s["device_expert_bytes_limit"]
    rt.restore()


def test_a_decode_forward_failing_midway_leaves_the_runtime_usable():
    from seqmoe.arch import cache_kwarg, output_cache

    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.5, "on-demand-lru", train=ref.train, control="thread")
    out = model(torch.tensor([PROMPT]), use_cache=True)  # a prompt: inline
    router = rt._layers[1].router

    def boom(module, args, output):
        raise ValueError("injected")

    handle = router.register_forward_hook(boom)  # after the runtime's hook: layer 1 is posted, then it raises
    with pytest.raises(ValueError, match="injected"):
        model(torch.tensor([[5]]), use_cache=True, **{cache_kwarg(model): output_cache(out)})
    handle.remove()
    t0 = time.perf_counter()
    assert rt.trace().num_tokens == len(PROMPT)  # the cut step is dropped, at once
    assert time.perf_counter() - t0 < 5 and rt.stats()["abandoned_tokens"] == 1
    assert torch.equal(greedy(model), ref.tokens)
    assert rt.trace().num_tokens == 2 * len(PROMPT) + 7
    rt.restore()
    assert torch.equal(greedy(model), ref.tokens)


def test_an_error_in_the_control_thread_reaches_the_model_thread():
    model = fresh("olmoe")
    rt = offload(model, 0.5, control="thread")
    greedy(model)
    ctrl = rt.controller
    ctrl.thread.launch()
    for layer in range(ctrl.L):  # a step whose routing names an expert the model does not have
        ctrl.mailbox.post(layer, torch.full((1, ctrl.K), ctrl.E), torch.ones(1, ctrl.K), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="control thread failed"):
        rt.stats()
    with pytest.raises(RuntimeError):
        rt.restore()

"""The host relay's device kernels (`relay_device`) on the CPU under TRITON_INTERPRET=1: each wait
against a host thread that answers late, never, or aborts, then whole posted decode steps.

    python -m tests.runtime.relay_interp_check      # prints "ok"; run by test_host_relay.py when triton is installed
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from seqmoe.runtime import DecodeGraph  # noqa: E402
from seqmoe.runtime.posted.host_relay import HostRelay  # noqa: E402
from seqmoe.runtime.posted.mailbox import Mailbox  # noqa: E402
from tests.runtime.conftest import PROMPT, reference  # noqa: E402
from tests.runtime.test_host_path import _decode, _full  # noqa: E402
from tests.runtime.test_host_relay import _offload  # noqa: E402

L, K, E, H = 3, 2, 5, 1500  # H spans two of the kernels' blocks


def _relay(disk=None, **spins) -> HostRelay:
    box = Mailbox(L, K, torch.device("cpu"), ring=4)
    relay = HostRelay(box, H, torch.float32, None, None, None, [torch.zeros(E, 1)], control_failed=lambda: False,
                      disk=disk)
    relay.use_kernels(**spins)
    return relay


def _later(fn, delay_s: float = 0.05) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), fn()))
    t.start()
    return t


def check_waits() -> None:
    relay = _relay()
    k = relay.kernels
    relay.box.posts.fill_(5 * L + 1 + 1)  # the router of layer 1 in step 5 has posted
    at = (5 % 4) * L + 1
    x, index, w = torch.randn(1, H), torch.tensor([[4, 2]]), torch.tensor([[0.75, 0.25]])
    k.post(1, x, index, w)
    assert relay.xseq[at] == 5 and torch.equal(relay.x[at, :H], x[0]) and relay.index[at, :K].tolist() == [4, 2]
    assert relay.weights[at, :K].tolist() == [0.75, 0.25]

    def decide():  # the host computes expert 2 (position 1)
        relay.on_host[at, 2] = 1
        relay.dseq[at] = 5

    t = _later(decide)
    kept, skip, _ = k.keep(1, index, w)
    t.join()
    assert kept.tolist() == [[0.75, 0.0]] and skip.tolist() == [0, 1] and relay.fallbacks == 0
    host = torch.randn(H)

    def answer():
        relay.out[at, :H] = host
        relay.oseq[at] = 5

    t = _later(answer)
    out = k.add(1, x.clone())
    t.join()
    assert torch.equal(out, x + host)
    relay.check()

    # a step of 2 rows: both rows' inputs posted, the host's positions of either row at weight 0, both outputs added
    relay.box.posts.fill_(6 * L + 1 + 1)
    at = (6 % 4) * L + 1
    x2, index2, w2 = torch.randn(2, H), torch.tensor([[4, 2], [1, 4]]), torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    k.post(1, x2, index2, w2)
    assert relay.xseq[at] == 6 and torch.equal(relay.x[at, :2 * H], x2.reshape(-1))
    assert relay.index[at, :2 * K].tolist() == [4, 2, 1, 4]
    relay.on_host[at] = 0
    relay.on_host[at, 4] = 1
    relay.dseq[at] = 6
    kept, skip, _ = k.keep(1, index2, w2)
    assert kept.tolist() == [[0.0, 0.25], [0.5, 0.0]] and skip.tolist() == [1, 0, 0, 1]
    host2 = torch.randn(2 * H)
    relay.out[at, :2 * H] = host2
    relay.oseq[at] = 6
    assert torch.equal(k.add(1, x2.clone()), x2 + host2.view(2, H))

    # no decision within the bound: the step computes every expert itself (exact), counted
    relay = _relay(keep_spins=50, out_spins=50)
    relay.box.posts.fill_(1)
    relay.on_host[0, 4] = 1  # stale from another step: ignored
    kept, skip, _ = relay.kernels.keep(0, index, w)
    assert kept.tolist() == w.tolist() and not skip.any() and relay.fallbacks == 1
    assert torch.equal(relay.kernels.add(0, x.clone()), x)  # and nothing is waited for or added
    # a decision but no output within the bound: NaN, counted, raised on the host
    relay.dseq[0] = 0
    relay.kernels.keep(0, index, w)
    assert torch.isnan(relay.kernels.add(0, x.clone())).all()
    try:
        relay.check()
        raise AssertionError("check() did not raise")
    except RuntimeError as e:
        assert "NaN" in str(e)

    # abort ends an unbounded-looking wait at once
    relay = _relay(keep_spins=1 << 30, out_spins=1 << 30)
    relay.box.posts.fill_(1)
    _later(relay.abort, 0.2)
    t0 = time.perf_counter()
    kept, _, _ = relay.kernels.keep(0, index, w)
    assert time.perf_counter() - t0 < 60 and kept.tolist() == w.tolist() and relay.fallbacks == 1


def check_disk_rows() -> None:
    """With a disk tier the decision carries each expert's host-cache row; without a decision no row is
    known, so the layer fails (NaN weights, counted) instead of falling back."""
    relay = _relay(disk=(object(), None), keep_spins=50, out_spins=50)
    k = relay.kernels
    relay.box.posts.fill_(2 * L + 1)  # layer 0 of step 2
    at = (2 % 4) * L
    index, w = torch.tensor([[4, 2]]), torch.tensor([[0.75, 0.25]])
    relay.hrow[at] = -1
    relay.hrow[at, 4] = 7
    relay.dseq[at] = 2
    kept, skip, rows = k.keep(0, index, w)
    assert kept.tolist() == w.tolist() and not skip.any() and rows.tolist() == [7, 0]  # expert 2: in a slot
    relay.box.posts.fill_(3 * L + 1)  # step 3: no decision
    kept, _, _ = k.keep(0, index, w)
    assert torch.isnan(kept).all() and relay.fallbacks == 0 and int(relay.status_np[1]) == 1


def check_posted_steps() -> None:
    tokens, step_logits = _full("olmoe")
    for miss in ("cpu", "auto"):
        model, rt = _offload("olmoe", miss=miss)
        rt.controller.relay.use_kernels()
        try:
            got, got_logits = _decode(model)
            graph = DecodeGraph(rt, 64).generate(torch.tensor([PROMPT]), 8)
            relay = rt.controller.relay
            assert relay.experts > 0 and relay.fallbacks == 0 and rt.stats()["host_relay_fallbacks"] == 0, miss
        finally:
            rt.restore()
        assert torch.equal(got, tokens) and torch.equal(graph, reference("olmoe").tokens), miss
        assert (got_logits - step_logits).abs().max().item() <= 1e-5, miss


def main() -> None:
    torch.set_num_threads(1)
    check_waits()
    check_disk_rows()
    check_posted_steps()
    print("ok")


if __name__ == "__main__":
    main()

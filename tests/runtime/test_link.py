"""The emulated link of a CPU pool: a miss waits for its queued copy; a host row read in place costs
link time; a non-CPU pool refuses it.

Run: pytest tests/runtime/test_link.py -q
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.runtime.core.copier import CopyWorker
from seqmoe.runtime.core.pool import ExpertPool

CPU = torch.device("cpu")
L, E, P = 2, 4, 8
LINK_S = 0.02


def _pool(capacity: int = 2) -> ExpertPool:
    hosts = [torch.arange(l * E, (l + 1) * E, dtype=torch.float32).repeat_interleave(P).view(E, P) for l in range(L)]
    return ExpertPool(hosts, capacity, CPU, link_s=LINK_S)


def test_a_miss_waits_for_its_queued_copy_and_reads_the_slot():
    pool = _pool()
    worker = CopyWorker(pool)
    try:
        slot, gen = pool.assign(5)  # layer 1, expert 1: its demand copy is queued, not yet landed
        worker.submit(5, slot, gen, demand=True, deadline_step=0)
        rows = pool.rows(1, [1])
        assert pool.loaded[slot] and (pool.pool_reads, pool.host_reads) == (1, 0)
        assert bool((rows[0] == 5).all())
    finally:
        worker.close()


def test_a_row_read_in_place_holds_the_link_for_one_copy_time():
    pool = _pool()
    t0 = time.perf_counter()
    rows = pool.rows(0, [2, 3])  # no slot, no copy: both rows cross the link
    assert time.perf_counter() - t0 >= 2 * LINK_S
    assert (pool.pool_reads, pool.host_reads) == (0, 2)
    assert bool((rows[1] == 3).all())


def test_a_reader_stops_waiting_when_the_slot_changes_hands():
    pool = _pool()
    pool.assign(5)  # a slot whose copy never comes: released while the reader waits
    timer = threading.Timer(0.05, pool.release, [5])
    timer.start()
    rows = pool.rows(1, [1])
    timer.join()
    assert (pool.pool_reads, pool.host_reads) == (0, 1) and bool((rows[0] == 5).all())


def test_only_a_cpu_pool_emulates_a_link():
    hosts = [torch.zeros(E, P) for _ in range(L)]
    with pytest.raises(UserError, match="emulated link"):
        ExpertPool(hosts, 2, torch.device("meta"), link_s=LINK_S)

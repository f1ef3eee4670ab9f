"""Copy channel ordering rules.  Run: pytest tests/brain/manager/test_channel.py -q"""

from seqmoe.brain.manager.channel import CopyChannel


def test_demand_goes_ahead_of_queued_prefetches_but_does_not_interrupt():
    e = CopyChannel(1.0)
    e.prefetch(1, deadline_step=5, now=0.0)  # starts at once, runs 0..1
    e.prefetch(2, deadline_step=6, now=0.0)  # queued
    assert e.advance(0.5) == []
    e.demand(3, now=0.5)
    assert e.demand_finish_times() == {3: 2.0}  # behind the running copy, ahead of prefetch 2
    assert e.advance(2.0) == [1, 3]
    assert e.advance(3.0) == [2]


def test_prefetches_run_earliest_deadline_first_and_promote():
    e = CopyChannel(1.0)
    e.prefetch(1, deadline_step=9, now=0.0)  # running
    e.prefetch(2, deadline_step=8, now=0.0)
    e.prefetch(3, deadline_step=7, now=0.0)
    e.prefetch(4, deadline_step=6, now=0.0)
    e.promote(2, now=0.0)  # needed now: ahead of 4 and 3
    assert e.advance(10.0) == [1, 2, 4, 3]
    assert e.started == 4


def test_cancel_drops_a_queued_copy():
    e = CopyChannel(1.0)
    e.prefetch(1, 1, 0.0)
    e.prefetch(2, 2, 0.0)
    assert e.cancel(2) and not e.cancel(1)  # 1 already running
    assert e.advance(5.0) == [1]


def test_idle_engine_starts_at_issue_time():
    e = CopyChannel(2.0)
    assert e.advance(10.0) == []
    e.demand(7, now=10.0)
    assert e.done_at[7] == 12.0

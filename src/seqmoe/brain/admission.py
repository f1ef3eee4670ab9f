"""Which waiting request takes a free row of a running batch: the rules' names and bounds, shared by
the simulator's lockstep replay (`seqmoe.sim.lockstep`) and the server (`seqmoe.serve.admission`)."""

ADMISSIONS = ("fifo", "overlap")
"""Who takes a free lane: the next request in arrival order, or the one whose routing overlaps most
with the running batch's."""
CANDIDATES = 16
"""Requests at the head of the queue the overlap rule chooses among."""
MAX_SKIPS = 4
"""Times in a row the head of the queue may be passed over (the fairness bound of `overlap`)."""

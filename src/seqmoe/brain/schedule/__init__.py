"""Prefetch schedulers behind one protocol (see `seqmoe.brain.schedule.base`)."""

from seqmoe.brain.schedule.base import PoolView, Prefetcher
from seqmoe.brain.schedule.greedy import GreedyPrefetcher, rank_candidates
from seqmoe.brain.schedule.oracle import OraclePrefetcher

__all__ = ["GreedyPrefetcher", "OraclePrefetcher", "PoolView", "Prefetcher", "rank_candidates"]

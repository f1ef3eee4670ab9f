"""Prefetch schedulers behind one protocol (see `seqmoe.schedule.base`)."""

from seqmoe.schedule.base import PoolView, Prefetcher
from seqmoe.schedule.greedy import GreedyPrefetcher, rank_candidates
from seqmoe.schedule.oracle import OraclePrefetcher

__all__ = ["GreedyPrefetcher", "OraclePrefetcher", "PoolView", "Prefetcher", "rank_candidates"]

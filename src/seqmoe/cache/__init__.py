"""Eviction policies behind one protocol (see `seqmoe.cache.base`)."""

from seqmoe.cache.base import EvictionPolicy
from seqmoe.cache.belady import BeladyPolicy, FutureUses, belady_misses, belady_schedule
from seqmoe.cache.lru import LayerLRUPolicy, LFUPolicy, LRUPolicy

__all__ = ["EvictionPolicy", "BeladyPolicy", "FutureUses", "belady_misses", "belady_schedule", "LayerLRUPolicy", "LFUPolicy", "LRUPolicy"]

"""Eviction policies behind one protocol (see `seqmoe.brain.policies.base`)."""

from seqmoe.brain.policies.base import EvictionPolicy
from seqmoe.brain.policies.belady import BeladyPolicy, FutureUses, belady_misses, belady_schedule
from seqmoe.brain.policies.lru import LayerLRUPolicy, LFUPolicy, LRUPolicy

__all__ = ["EvictionPolicy", "BeladyPolicy", "FutureUses", "belady_misses", "belady_schedule", "LayerLRUPolicy", "LFUPolicy", "LRUPolicy"]

"""Routing traces: schema, import, storage, statistics, splits."""

from seqmoe.trace.schema import RoutingTrace, TraceError, TraceMeta

__all__ = ["RoutingTrace", "TraceError", "TraceMeta"]

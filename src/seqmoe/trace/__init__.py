"""Routing traces: schema, import, storage, statistics, splits. Imports only `base`."""

from seqmoe.trace.schema import RoutingTrace, TraceError, TraceMeta

__all__ = ["RoutingTrace", "TraceError", "TraceMeta"]

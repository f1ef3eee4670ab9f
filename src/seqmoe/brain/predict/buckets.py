"""Token hash buckets: the sequence forecaster knows a token by the crc32 of its string (or id), in B buckets.

    table = bucket_table(trace, B)         # [V] bucket of every token id of the trace's vocabulary
    b = bucket_of(token_id, table, B)      # one id (B: unknown)
"""

from __future__ import annotations

import zlib

import numpy as np

from seqmoe.trace.schema import RoutingTrace


def token_bucket(token: str | int | None, buckets: int) -> int:
    """Hash bucket of a token string (or int id when there is no vocabulary); None -> unknown (= buckets)."""
    if token is None:
        return buckets
    data = token.encode("utf-8") if isinstance(token, str) else int(token).to_bytes(8, "little", signed=True)
    return zlib.crc32(data) % buckets


def bucket_table(trace: RoutingTrace, buckets: int) -> np.ndarray | None:
    """[V] int64 bucket of every token id of `trace` (hash of the string when it has a vocab); None without ids."""
    if trace.token_ids is None:
        return None
    if trace.vocab is not None:
        return np.array([token_bucket(s, buckets) for s in trace.vocab], dtype=np.int64)
    return np.array([token_bucket(i, buckets) for i in range(int(trace.token_ids.max()) + 1)], dtype=np.int64)


def bucket_of(token_id: int | None, table: np.ndarray | None, buckets: int) -> int:
    """Bucket of a token id: through `table` (`bucket_table` of the trace's vocabulary) when given,
    else the hash of the id; None or an id outside the table -> unknown (= buckets)."""
    if token_id is None:
        return buckets
    if table is not None:
        return int(table[token_id]) if 0 <= token_id < len(table) else buckets
    return token_bucket(int(token_id), buckets)


def trace_buckets(trace: RoutingTrace, buckets: int) -> np.ndarray:
    """[T] int64 token bucket of every token (all `buckets`, i.e. unknown, without token ids)."""
    table = bucket_table(trace, buckets)
    if table is None:
        return np.full(trace.num_tokens, buckets, dtype=np.int64)
    return table[trace.token_ids.astype(np.int64)]

"""Harnesses that time the runtime: greedy decode against the full model on the CPU (`decode`,
`seqmoe bench-runtime`), and real-size models forced to real routing (`forced`, `replay`). The
scripts in benchmarks/ call them.
"""

from seqmoe.base.errors import UserError


def check_bench(new_tokens: int, repeats: int, link_ratio: float) -> None:
    """UserError unless a decode bench has tokens to time (the first comes from the prompt), a pass
    to time, and a link that takes time."""
    if new_tokens < 2 or repeats < 1 or not link_ratio > 0:
        raise UserError(f"need new_tokens >= 2, repeats >= 1 and link_ratio > 0 (got {new_tokens}, {repeats}, {link_ratio})")

"""`seqmoe.base.heap`: the command's allocator setting takes on glibc, and trim runs after it.
Run: pytest tests/base/test_heap.py -q
"""

from __future__ import annotations

import platform

import pytest

from seqmoe.base import heap


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_step_sized_allocations_stay_on_the_heap_on_glibc():
    assert heap.keep_freed_blocks()
    heap.trim()

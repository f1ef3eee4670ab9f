"""Where numba keeps the compiled kernels: a folder named by a hash of all their sources.

numba checks a cached function against its own source file only; a kernel that calls into
another module (step -> deadline -> policies -> channel) would keep the callee's old code after that
module changed. One folder per hash of every kernel module, of the modules whose constants they
read, and of the numba and Python versions makes any change anywhere recompile everything.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

import numba

MODULES = ("layout", "channel", "recency", "prior", "forecast", "policies", "ops", "miss_paths", "deadline", "step")
"""The kernel modules of this package, in import order."""
CONSTANTS = ("brain/policies/reuse.py", "brain/manager/miss_paths.py")
"""Modules outside this package whose globals the kernels read (numba freezes them into the code)."""


def build_dir() -> Path:
    """$SEQMOE_CACHE/numba/<hash>: the folder of this version of the kernels."""
    h = hashlib.sha256(f"{numba.__version__} {sys.version}".encode())
    here = Path(__file__).parent
    for name in MODULES:
        h.update((here / f"{name}.py").read_bytes())
    for rel in CONSTANTS:
        h.update((here.parents[2] / rel).read_bytes())
    root = Path(os.environ.get("SEQMOE_CACHE", Path.home() / ".cache" / "seqmoe"))
    return root / "numba" / h.hexdigest()[:16]


@contextlib.contextmanager
def use_build_dir():
    """While the kernel modules are imported, numba keeps its compiled code in `build_dir()`."""
    before = numba.config.CACHE_DIR
    try:
        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        numba.config.CACHE_DIR = str(folder)
    except OSError:  # no writable cache: numba falls back to its own places
        pass
    try:
        yield
    finally:
        numba.config.CACHE_DIR = before

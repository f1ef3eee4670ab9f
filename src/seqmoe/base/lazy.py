"""Package attributes imported on first use, so that a package whose modules need torch or numba can
hold one that does not (`seqmoe.arch.model_dirs`, `seqmoe.brain.manager.miss_paths`) and a command
checks its options before they load.

    __getattr__ = lazy_exports(__name__, {"adapter": ("model_arch", ...)})

An exported name must not be a submodule's: importing the submodule sets the package attribute.
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, homes: dict[str, tuple[str, ...]]):
    """A module `__getattr__` for `package` importing each name of `homes` (submodule -> names) from
    its submodule on first use."""
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str):
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home[name]}"), name)

    return __getattr__

"""Package attributes imported on first use: a package whose modules need torch can still hold a
module that does not (`seqmoe.arch.model_dirs`, `seqmoe.runtime.timing`), so a command checks its
options before torch loads.

    __getattr__ = lazy_exports(__name__, {"adapter": ("model_arch", ...)})
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, homes: dict[str, tuple[str, ...]]):
    """A module `__getattr__` for `package` that imports each name of `homes` (module -> names) from its
    module on first use."""
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str):
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home[name]}"), name)

    return __getattr__

"""Every script in benchmarks/ still imports against the library (their `main` is not run: they
take minutes or a GPU), so a renamed or removed name fails here rather than in the next session.

Run: pytest tests/test_benchmarks.py -q
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_the_script_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts share helpers (puffin_split)
    spec = importlib.util.spec_from_file_location(f"benchmark_{script[:-3]}", BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)) or script == "puffin_split.py"
    sys.modules.pop(spec.name, None)

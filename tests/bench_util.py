"""Loading a script under bench/ as a module, for tests of its pure functions (bench/ is not a package; its scripts
import each other by name, so bench/ is on sys.path while one loads)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """bench/NAME.py as a module."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))

"""A bench/ script loaded as a module, for the tests of its arithmetic (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def load_bench(filename: str, module_name: str) -> ModuleType:
    """``bench/<filename>`` imported under ``module_name`` (registered in sys.modules: dataclasses look their
    module up)."""
    spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / filename)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = mod
    spec.loader.exec_module(mod)
    return mod

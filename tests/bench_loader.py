"""Imports a script of benchmarks/ as a module for its tests (benchmarks are not a package)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def benchmark_module(name: str):
    """benchmarks/<name>.py as module `benchmark_<name>`, registered while the block runs
    (dataclasses and pickling look modules up in sys.modules)."""
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)

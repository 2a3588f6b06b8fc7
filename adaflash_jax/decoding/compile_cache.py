"""Ahead-of-time compilation with a process-wide cache of executables.

Decode loops are compiled explicitly (lower + compile) so that reported
throughput never includes compilation, and the compile time is reported
separately. Executables are keyed by the static arguments and the abstract
signature (shape, dtype, sharding) of every array argument.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

_EXECUTABLES: dict[Any, Any] = {}


def _signature(args) -> tuple:
    def one(x):
        if isinstance(x, jax.Array):
            return (x.shape, str(x.dtype), x.sharding)
        return ("static", x)

    return tuple(one(x) for x in jax.tree.leaves(args))


def compiled(fn: Callable, static_args: tuple, dynamic_args: tuple,
             static_kwargs: dict) -> tuple[Callable, float]:
    """Returns (executable taking `dynamic_args`, seconds spent compiling now)."""
    key = (fn, static_args, _signature(dynamic_args), tuple(sorted(static_kwargs.items())))
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    t0 = time.perf_counter()
    exe = fn.lower(*static_args, *dynamic_args, **static_kwargs).compile()
    _EXECUTABLES[key] = exe
    return exe, time.perf_counter() - t0


def clear() -> None:
    """Forgets every cached executable (e.g. after patching code that the loops trace)."""
    _EXECUTABLES.clear()

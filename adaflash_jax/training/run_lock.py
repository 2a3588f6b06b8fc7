"""One job per run directory: training entry points hold `<checkpoint.dir>/.lock`.

Two trainers on one run directory would interleave steps into the same
checkpoints and drafter; the second one fails at start instead
(`errors.RunDirBusyError`). Only process 0 of a multi-process job takes the
lock: its peers share the directory by design.
"""

from __future__ import annotations

import functools
import os

import jax

from adaflash_jax.atomic_io import run_dir_lock


def locks_run_dir(fn):
    """Decorates `fn(config, ...)` to run holding the lock of `config.checkpoint.dir`."""

    @functools.wraps(fn)
    def locked(config, *args, **kwargs):
        if not config.checkpoint.dir or jax.process_index() != 0:
            return fn(config, *args, **kwargs)  # fn reports a missing checkpoint.dir itself
        with run_dir_lock(os.path.abspath(config.checkpoint.dir)):
            return fn(config, *args, **kwargs)

    return locked

"""Crash- and collision-safe file writes, and advisory locks.

Every write goes to a uniquely named temporary file (or directory) beside its
destination and is renamed into place, so a reader never sees half a file and
two writers never share a temporary name. `file_lock` serialises
read-modify-write cycles on shared files (a sidecar `.lock` file, `flock`);
`run_dir_lock` keeps a second job out of a run directory that one is using.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile

from adaflash_jax.errors import RunDirBusyError


def temp_path_beside(path: str, suffix: str = "") -> str:
    """A new, empty, uniquely named file in `path`'s directory (the caller renames it)."""
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=suffix + ".tmp", dir=parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would outlive the rename
    return tmp


def atomic_write_text(path: str, text: str) -> None:
    tmp = temp_path_beside(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def atomic_write_json(path: str, obj, **dump_kwargs) -> None:
    atomic_write_text(path, json.dumps(obj, **dump_kwargs))


def staging_dir_beside(path: str) -> str:
    """A new, uniquely named directory next to `path`, to be moved in by `replace_dir`."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(path))}.", suffix=".tmp",
                               dir=parent)
    os.chmod(staging, 0o777 & ~_umask())
    return staging


def replace_dir(staging: str, path: str) -> None:
    """Moves the finished `staging` dir to `path`; an existing `path` is renamed away first and
    deleted only once the new one is in place, so some complete version always exists."""
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(path))}.", suffix=".old",
                               dir=os.path.dirname(os.path.abspath(path)))
        os.rmdir(old)
        os.rename(path, old)
    try:
        os.rename(staging, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: str):
    """Exclusive advisory lock on `path + ".lock"` for the duration of the block (blocking)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def run_dir_lock(run_dir: str):
    """Holds `<run_dir>/.lock` exclusively for the block; RunDirBusyError if another job has it."""
    os.makedirs(run_dir, exist_ok=True)
    lock_path = os.path.join(run_dir, ".lock")
    handle = open(lock_path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            raise RunDirBusyError(f"run directory {run_dir} is in use by another job ({owner}); wait for "
                                  "it to finish or use another checkpoint.dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        yield
    finally:
        handle.close()  # closing drops the lock


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)

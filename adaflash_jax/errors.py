"""Exception types that tell a user's mistake apart from a bug.

The CLI turns `InputError` (and only it) into a one-line message with exit
code 2; any other exception keeps its traceback, so an internal failure never
looks like a bad argument. `InputError` subclasses ValueError, so callers that
catch ValueError for bad input keep working.
"""

from __future__ import annotations

import contextlib


class InputError(ValueError):
    """Bad user input: an argument, a config value, a prompt, a path or a checkpoint."""


class RunDirBusyError(InputError):
    """Another job holds the run directory's lock (two trainers must not share one run)."""


@contextlib.contextmanager
def as_input_error(*types: type[BaseException]):
    """Re-raises `types` (default ValueError) from a call that only validates user input as
    InputError, the original chained.

    For validators owned by modules that raise plain ValueError (config parsing,
    sampling settings); wrap validation calls only, never computation.
    """
    try:
        yield
    except InputError:
        raise
    except types or (ValueError,) as error:
        raise InputError(str(error)) from error

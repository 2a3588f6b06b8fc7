"""Training time across resumes: the x axis of τ-vs-compute curves and the `max_minutes` stop.

A run's compute is the wall time spent inside `train` calls, summed over every
resume. `RunClock` keeps it in <run_dir>/train_time.json (per saved step, so a
resumed run continues from the seconds its checkpoint had) and appends each
held-out evaluation, with that time, to <run_dir>/evals.jsonl.
"""

from __future__ import annotations

import json
import os
import time

from adaflash_jax.atomic_io import atomic_write_json


class RunClock:
    def __init__(self, run_dir: str, resumed_step: int | None, max_minutes: float | None):
        self.path = os.path.join(run_dir, "train_time.json")
        self.evals_path = os.path.join(run_dir, "evals.jsonl")
        self.max_seconds = None if max_minutes is None else 60.0 * max_minutes
        self.saved = self._load()
        self.before = float(self.saved.get(str(resumed_step), 0.0)) if resumed_step is not None else 0.0
        if resumed_step is None:
            self.saved = {}
        self.start = time.perf_counter()

    def _load(self) -> dict:
        if not os.path.exists(self.path):
            return {}
        with open(self.path) as f:
            return json.load(f)

    def call_seconds(self) -> float:
        """Seconds since this `train` call started."""
        return time.perf_counter() - self.start

    def seconds(self) -> float:
        """Training seconds of the whole run so far (earlier calls included)."""
        return self.before + self.call_seconds()

    def out_of_time(self) -> bool:
        return self.max_seconds is not None and self.call_seconds() >= self.max_seconds

    def record(self, step: int) -> None:
        """Remembers the run's seconds at a saved step (atomically: a crash keeps the old file)."""
        self.saved[str(step)] = round(self.seconds(), 1)
        atomic_write_json(self.path, self.saved)

    def log_eval(self, row: dict) -> None:
        with open(self.evals_path, "a") as f:
            f.write(json.dumps(row) + "\n")

"""Acceptance and verify statistics of a decode, from the engine's per-step counts.

numpy only: the serving runtime reports the same numbers as `generate` without
importing the engine.
"""

from __future__ import annotations

import numpy as np


def verify_stats(verified: np.ndarray, commits: np.ndarray, drafted_steps: int, steps: int) -> dict:
    """Mean verify length and verified tokens per committed token over live row-steps, and
    the share of the engine's steps that drafted."""
    live = verified > 0
    total_verified, total_committed = int(verified.sum()), int(commits.sum())
    return {"mean_verify_len": float(verified[live].mean()) if live.any() else 0.0,
            "verified_per_committed": total_verified / total_committed if total_committed else 0.0,
            "drafted_step_fraction": drafted_steps / steps if steps else 0.0}


def acceptance_stats(commits: np.ndarray, steps: int) -> dict:
    """τ and per-step acceptance lengths from the engine's commit counts [B, cap] (row i:
    the tokens each verify step of request i committed, 0 past its last step)."""
    per_seq = [[int(c) for c in row[:steps] if c > 0] for row in commits]
    flat = [c for row in per_seq for c in row]
    return {"acceptance_lengths": per_seq, "verify_steps": steps,
            "mean_tau": float(np.mean(flat)) if flat else 0.0}

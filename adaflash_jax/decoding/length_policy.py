"""`generate`'s length-policy settings: names, validation, and the statistics they report.

The policies themselves run inside the engine's step (`speculative.py`); their
per-step plan (the AdaFlash head rule, and the expected-commits-per-second
optimisation of "auto") is `verify_plan.py`.
"""

from __future__ import annotations

import numpy as np

POLICIES = ("fixed", "head", "auto")


def resolve(policy: str | None, drafter, verify_len, rho: float, min_len: int, probe_every: int) -> str:
    """The validated policy name: default "auto" with a length head, else "fixed"."""
    if policy is None:
        policy = "auto" if drafter.has_length_head and verify_len is None else "fixed"
    if policy not in POLICIES:
        raise ValueError(f"unknown length_policy {policy!r}; choose one of {POLICIES}")
    if policy == "fixed":
        return policy
    if not drafter.has_length_head:
        raise ValueError(f"length_policy={policy!r} needs a drafter with a length head "
                         f"({drafter.name or 'this drafter'} has none); use 'fixed'")
    if verify_len is not None:
        raise ValueError(f"verify_len applies to length_policy='fixed' only (got {policy!r})")
    if rho <= 0:
        raise ValueError(f"rho must be positive, got {rho}")
    if not 1 <= int(min_len) <= drafter.block_size:
        raise ValueError(f"min_len must lie in [1, block_size={drafter.block_size}], got {min_len}")
    if int(probe_every) < 1:
        raise ValueError(f"probe_every must be >= 1, got {probe_every}")
    return policy


def unit_costs(buckets):
    """Costs for the "head" policy, which never reads them (its lengths come from the rule);
    they only keep both adaptive policies on one compiled signature."""
    import jax.numpy as jnp

    from adaflash_jax.decoding.verify_plan import StepCosts

    return StepCosts(jnp.asarray(buckets, jnp.float32), jnp.float32(0.0), jnp.float32(buckets[0]))


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

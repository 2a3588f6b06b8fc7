"""Choosing how many drafted tokens to verify, from a measured cost model.

The reference AdaFlash gates its length head on a fixed load threshold. Here the
decision is an explicit optimisation: per decode step, pick verify lengths L_i
that maximise expected committed tokens per second,

    Σ_i E_i(L_i) / (t_draft(B) + t_verify(B, L))

where E_i(L) is the expected number of tokens a verify of L tokens commits for
sequence i and t_* come from timings calibrated once on the running hardware.

Acceptance model: the length head predicts ŝ_i, the fraction of the block a
full verify commits, i.e. expected committed tokens m_i = ŝ_i · Bs. Draft tokens
are accepted one after another with a per-token probability p_i, so a verify of
L tokens commits E(L) = Σ_{k<L} p^k = (1 − p^L)/(1 − p) tokens; p_i is the root
of E(Bs) = m_i. E is concave in L, so for a fixed token budget the greedy
marginal allocation below is optimal.

Two layouts: `uniform` (one L for the whole batch; the static-shape verify costs
B × L tokens) and `packed` (per-sequence L_i packed into one buffer of Σ L_i
tokens, padded to a bucket). L = 1 everywhere is plain AR: no draft is needed.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def per_token_acceptance(expected_commit: np.ndarray, block_size: int) -> np.ndarray:
    """p with (1 − p^Bs)/(1 − p) = m (m in [1, Bs]), by bisection (vectorised)."""
    m = np.clip(np.asarray(expected_commit, np.float64), 1.0, float(block_size))
    lo, hi = np.zeros_like(m), np.ones_like(m)
    for _ in range(60):
        mid = (lo + hi) / 2
        too_many = expected_commits(mid, block_size) > m
        hi = np.where(too_many, mid, hi)
        lo = np.where(too_many, lo, mid)
    return (lo + hi) / 2


def expected_commits(p, length) -> np.ndarray:
    """E(L) = Σ_{k<L} p^k for per-token acceptance p (broadcasts)."""
    p = np.asarray(p, np.float64)
    length = np.asarray(length, np.float64)
    safe = np.where(np.isclose(p, 1.0), 0.5, p)
    return np.where(np.isclose(p, 1.0), length, (1 - safe ** length) / (1 - safe))


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Step costs in seconds, measured at (batch, tokens) grid points; linear in between.

    verify[i][j]: a target forward over `tokens[j]` tokens per row at batch `batches[i]`;
    a packed buffer of N tokens over b sequences is costed as b rows of N / b tokens
    (the same matmul work). draft[i]: one drafter block at batch `batches[i]`.
    """

    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    verify: tuple[tuple[float, ...], ...]
    draft: tuple[float, ...]

    def verify_s(self, batch: int, tokens: float) -> float:
        rows = [np.interp(tokens, self.tokens, row) for row in self.verify]
        return float(np.interp(batch, self.batches, rows))

    def draft_s(self, batch: int) -> float:
        return float(np.interp(batch, self.batches, self.draft))


def step_rate(commits: float, cost_s: float) -> float:
    return commits / cost_s if cost_s > 0 else 0.0


def choose_uniform(scores, block_size: int, costs: CostModel) -> tuple[int, float]:
    """(L, expected tokens/s): one verify length for the whole batch (static shapes)."""
    p = per_token_acceptance(np.asarray(scores) * block_size, block_size)
    b = len(p)
    best = (1, step_rate(b, costs.verify_s(b, 1)))  # L = 1: plain AR, no draft
    for length in range(2, block_size + 1):
        rate = step_rate(float(expected_commits(p, length).sum()),
                         costs.draft_s(b) + costs.verify_s(b, length))
        if rate > best[1]:
            best = (length, rate)
    return best


def allocate(p: np.ndarray, budget: int, block_size: int) -> np.ndarray:
    """Per-sequence lengths (each in [1, Bs], Σ ≤ budget) maximising Σ E_i(L_i): greedy on
    marginal gains, optimal because every E_i is concave in L."""
    lengths = np.ones(len(p), np.int64)
    spare = budget - len(p)
    while spare > 0:
        gain = np.where(lengths < block_size, np.asarray(p, np.float64) ** lengths, -1.0)
        i = int(np.argmax(gain))
        if gain[i] <= 0:
            break
        lengths[i] += 1
        spare -= 1
    return lengths


def choose_packed(scores, block_size: int, costs: CostModel, buckets) -> tuple[np.ndarray, float]:
    """(per-sequence lengths, expected tokens/s) for packed verification into a bucket of tokens."""
    p = per_token_acceptance(np.asarray(scores) * block_size, block_size)
    b = len(p)
    best = (np.ones(b, np.int64), step_rate(b, costs.verify_s(b, 1)))  # all L = 1: AR
    for bucket in sorted(buckets):
        if bucket <= b:
            continue
        lengths = allocate(p, min(bucket, b * block_size), block_size)
        rate = step_rate(float(expected_commits(p, lengths).sum()),
                         costs.draft_s(b) + costs.verify_s(b, bucket / b))
        if rate > best[1]:
            best = (lengths, rate)
    return best


# --- generate()'s policy settings and statistics --------------------------------------------------

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


def verify_stats(verified: np.ndarray, commits: np.ndarray, drafted: np.ndarray) -> dict:
    """Mean verify length and verified tokens per committed token over live row-steps."""
    live = verified > 0
    total_verified, total_committed = int(verified.sum()), int(commits.sum())
    return {"mean_verify_len": float(verified[live].mean()) if live.any() else 0.0,
            "verified_per_committed": total_verified / total_committed if total_committed else 0.0,
            "drafted_step_fraction": float(np.mean(drafted)) if drafted.size else 0.0}

"""Per-step verify plans inside the jitted engine: how many tokens each row verifies.

The objective: per decode step, the lengths L_i that maximise expected committed
tokens per second, Σ_i E_i(L_i) / (t_draft + t_verify(bucket)), with costs
calibrated on the running hardware. Acceptance model: the length head predicts
ŝ_i, the fraction of the block a full verify commits; drafts are accepted one
after another with per-token probability p_i, so a verify of L tokens commits
E(L) = Σ_{k<L} p^k, and p_i solves E(Bs) = ŝ_i·Bs. E is concave in L, so greedy
marginal allocation is optimal for a token budget (tests check all of this
against brute force). In the packed layout a step verifies Σ L_i tokens padded
to one of a few static bucket sizes:

- `head_lengths`: the AdaFlash rule `Lv = clamp(round(ŝ·Bs·ρ), Lmin, Bs)` per row.
- `best_allocation`: per bucket N, the lengths maximising expected commits
  Σ E_i(L_i) with Σ L_i ≤ N (top marginal gains p_i^l; optimal since E_i is
  concave), then the bucket with the most expected commits per second under the
  calibrated step costs.
- `drafting_pays`: whether drafting pays at all this step, from running acceptance
  estimates; when it does not, the step is plain AR (every live row verifies only
  its bonus token and no draft is run), except for periodic probes that refresh
  the estimates, verifying at least one draft per live row (`next_probe_gap`
  backs them off while drafting keeps losing).
- `corrected_acceptance` / `observe_acceptance`: each slot's realized acceptance
  corrects the head's p_i (below), so both decisions above use the corrected p.

Acceptance feedback. Under the acceptance model a verify of L tokens that accepts a
drafts examined n = min(a + 1, L − 1) of them: a successes and, if a < L − 1, one
failure; the per-token acceptance maximising the likelihood a·log p + [a < L−1]·log(1−p)
of such steps is successes / examined. Each slot keeps counts over its request's
verify steps, discounted by λ (`PlanParams.feedback_decay`) per step: hits (accepted),
trials (examined) and predicted (Σ n·p_head, what the head expected of the same
trials). The head's estimate is then moved in log-odds by the gap between realized and
predicted acceptance, `p = σ(logit p_head + logit r − logit h)` with h = predicted /
trials and r = (hits + k0·h) / (trials + k0): a logistic calibration of the head per
slot, which keeps its block-to-block ranking and matches its mean to what the slot
realizes; k0 (`PlanParams.prior_trials`) pseudo-trials at the head's own rate keep a
slot with few observations close to the head. A slot with no observations uses the
head's estimate unchanged.

Finished rows verify nothing (L = 0), so they cost nothing in the packed buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


MAX_PROBE_GAP = 64
FEEDBACK_EPS = 1e-3  # probabilities are clipped to [ε, 1 − ε] before taking log-odds


class StepCosts(NamedTuple):
    """Calibrated seconds, measured at the engine's padded batch (see decoding/calibration.py)."""

    verify_s: jax.Array  # float32 [K]: one packed verify of each bucket's token count
    draft_s: jax.Array  # float32 []: one drafter block for the whole batch
    ar_s: jax.Array  # float32 []: one AR step of the engine (each row verifies its bonus only)


class PlanParams(NamedTuple):
    """Dynamic policy settings (changing them never recompiles)."""

    rho: jax.Array  # float32 []: head-rule scale
    min_len: jax.Array  # int32 []: head-rule floor
    costs: StepCosts
    probe_every: jax.Array  # int32 []: draft at least this often while drafting pays (backs off)
    start: "ProbeState"  # where the acceptance estimate and probe schedule begin
    feedback_decay: jax.Array | float = 0.95  # λ: weight of a slot's past verify steps per step
    prior_trials: jax.Array | float = 1.0  # k0: the head's estimate counts as this many trials


class ProbeState(NamedTuple):
    """The "auto" policy's running state, carried from one generate call to the next so a
    long-running process does not re-learn its drafter's acceptance on every call. The
    per-slot feedback counts are not part of it: they describe one request, and every new
    request starts without them."""

    p: jax.Array  # float32 []: per-token acceptance estimate, feedback-corrected (0: unknown)
    since_draft: jax.Array  # int32 []: steps since the last drafted step
    gap: jax.Array  # int32 []: steps between forced probes

    @classmethod
    def fresh(cls, probe_every: int) -> "ProbeState":
        """Nothing known: the first step probes."""
        return cls(jnp.float32(0.0), jnp.int32(probe_every), jnp.int32(probe_every))


def length_rule(scores: jax.Array, block_size: int, rho, min_len) -> jax.Array:
    """`Lv = clamp(round(ŝ·Bs·ρ), Lmin, Bs)` for settings that may be traced (checked by the
    caller, `length_policy.check_rule_settings`). A NaN score (the drafter was fed a
    non-finite token) gives Lmin: cast as it is, it would give 0, and a row that verifies
    nothing never sees its own non-finite logits."""
    return jnp.clip(jnp.round(jnp.nan_to_num(scores) * block_size * rho), min_len, block_size).astype(jnp.int32)


def head_lengths(scores: jax.Array, live: jax.Array, block_size: int, rho, min_len) -> jax.Array:
    """int32 [B]: the head rule for live rows, 0 for finished ones."""
    return jnp.where(live, length_rule(scores, block_size, rho, min_len), 0)


def per_token_acceptance(scores: jax.Array, block_size: int, iters: int = 40) -> jax.Array:
    """p with E(Bs) = Σ_{k<Bs} p^k = ŝ·Bs (clipped to [1, Bs]), by vectorised bisection."""
    m = jnp.clip(scores * block_size, 1.0, float(block_size))

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        over = expected_commits(mid, block_size) > m
        return jnp.where(over, lo, mid), jnp.where(over, mid, hi)

    lo, hi = jax.lax.fori_loop(0, iters, step, (jnp.zeros_like(m), jnp.ones_like(m)))
    return (lo + hi) / 2


def expected_commits(p: jax.Array, length) -> jax.Array:
    """E(L) = Σ_{k<L} p^k = (1 − p^L)/(1 − p) (L where p = 1; 0 where L = 0)."""
    length = jnp.asarray(length, jnp.float32)
    near_one = p > 1 - 1e-6
    safe = jnp.where(near_one, 0.5, p)
    return jnp.where(near_one, length, (1 - safe ** length) / (1 - safe))


def _logit(p: jax.Array) -> jax.Array:
    p = jnp.clip(p, FEEDBACK_EPS, 1 - FEEDBACK_EPS)
    return jnp.log(p) - jnp.log1p(-p)


def corrected_acceptance(head_p: jax.Array, hits: jax.Array, trials: jax.Array, predicted: jax.Array,
                         prior_trials) -> jax.Array:
    """float32 [B]: the head's per-token acceptance head_p corrected by each slot's discounted
    feedback counts (the module docstring's rule); head_p itself where a slot has none."""
    seen = trials > 0
    h = jnp.where(seen, predicted / jnp.where(seen, trials, 1.0), head_p)
    r = (hits + prior_trials * h) / jnp.maximum(trials + prior_trials, 1e-9)
    return jnp.where(seen, jax.nn.sigmoid(_logit(head_p) + _logit(r) - _logit(h)), head_p)


def feedback_shift(hits: jax.Array, trials: jax.Array, predicted: jax.Array, prior_trials) -> jax.Array:
    """float32 [B]: logit r − logit h of each slot's feedback counts (the module docstring's
    correction, 0 for a slot without observations): added to the log-odds of any per-token
    acceptance estimate of the same kind (tree verification applies it to every node)."""
    seen = trials > 0
    h = jnp.where(seen, predicted / jnp.where(seen, trials, 1.0), 0.5)
    r = (hits + prior_trials * h) / jnp.maximum(trials + prior_trials, 1e-9)
    return jnp.where(seen, _logit(r) - _logit(h), 0.0)


def fold_feedback(hits: jax.Array, trials: jax.Array, predicted: jax.Array, accepted: jax.Array,
                  examined: jax.Array, expected: jax.Array, seen: jax.Array, decay):
    """The counts after one step, for the rows in `seen`: each count decays by λ and adds the
    step's accepted drafts, examined drafts and the acceptances predicted for them."""
    def fold(total, x):
        return jnp.where(seen, decay * total + x.astype(jnp.float32), total)

    return fold(hits, accepted), fold(trials, examined), fold(predicted, expected)


def observe_acceptance(hits: jax.Array, trials: jax.Array, predicted: jax.Array, head_p: jax.Array,
                       accepted: jax.Array, lengths: jax.Array, observed: jax.Array, decay):
    """The feedback counts after a verify step that accepted `accepted` of the drafts in
    `lengths` tokens, for the rows in `observed` that verified at least one draft (others
    keep theirs); head_p: the head's estimate the step planned with."""
    examined = jnp.minimum(accepted + 1, lengths - 1).astype(jnp.float32)
    seen = observed & (lengths >= 2)

    def fold(total, x):
        return jnp.where(seen, decay * total + x, total)

    return (fold(hits, accepted.astype(jnp.float32)), fold(trials, examined),
            fold(predicted, examined * head_p))


def allocate(p: jax.Array, live: jax.Array, budget, block_size: int) -> jax.Array:
    """int32 [B]: live rows get 1 + their share of the top (budget − #live) marginal gains
    p_i^l (l = 1..Bs−1); finished rows get 0. Ties break by row order."""
    b = p.shape[0]
    levels = jnp.arange(1, block_size, dtype=jnp.float32)
    gains = jnp.where(live[:, None], p[:, None] ** levels[None], -1.0).reshape(-1)
    rank = jnp.argsort(jnp.argsort(-gains, stable=True), stable=True)
    extra = jnp.maximum(budget - jnp.sum(live), 0)
    chosen = (rank < extra) & (gains >= 0)
    return jnp.where(live, 1 + jnp.sum(chosen.reshape(b, block_size - 1), axis=1), 0).astype(jnp.int32)


def best_allocation(p: jax.Array, live: jax.Array, buckets: tuple[int, ...], block_size: int,
                    costs: StepCosts) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(lengths [B], bucket index, expected commits per second) of the best bucket when
    drafting; buckets too small for one token per live row are never chosen."""
    n_live = jnp.sum(live)
    rates, plans = [], []
    for k, bucket in enumerate(buckets):
        lengths = allocate(p, live, bucket, block_size)
        commits = jnp.sum(jnp.where(live, expected_commits(p, lengths), 0.0))
        rate = commits / (costs.draft_s + costs.verify_s[k])
        rates.append(jnp.where(bucket >= n_live, rate, -jnp.inf))
        plans.append(lengths)
    rates = jnp.stack(rates)
    best = jnp.argmax(rates).astype(jnp.int32)
    return jnp.stack(plans)[best], best, rates[best]


def ar_rate(live: jax.Array, costs: StepCosts) -> jax.Array:
    """Commits per second of a plain AR step: every live row verifies one token, no draft."""
    return jnp.sum(live) / costs.ar_s


def drafting_pays(p: jax.Array, live: jax.Array, buckets: tuple[int, ...], block_size: int,
                  costs: StepCosts) -> jax.Array:
    """True when the best drafted step beats a plain AR step in expected commits per second."""
    _, _, rate = best_allocation(p, live, buckets, block_size, costs)
    return rate > ar_rate(live, costs)


def next_probe_gap(drafted: jax.Array, pays: jax.Array, gap: jax.Array, probe_every) -> jax.Array:
    """Steps until the next forced draft: back to `probe_every` while drafting pays, doubled
    (up to MAX_PROBE_GAP) after each probe that showed it does not, so a drafter that never
    pays costs a vanishing share of the steps."""
    backoff = jnp.minimum(2 * gap, MAX_PROBE_GAP)
    return jnp.where(drafted, jnp.where(pays, probe_every, backoff), gap).astype(jnp.int32)


def bucket_index(total: jax.Array, buckets: tuple[int, ...]) -> jax.Array:
    """Index of the smallest bucket holding `total` tokens (buckets ascending; the last fits all)."""
    return jnp.argmax(jnp.asarray(buckets) >= total).astype(jnp.int32)

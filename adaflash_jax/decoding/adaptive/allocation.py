"""Per-row node budgets for one step: the joint choice that maximises expected committed
tokens per second.

Row b verifying a tree of n nodes commits 1 + E_b(n) tokens in expectation (E_b(1) = 0:
the root alone is a plain AR token). The rows' nodes are verified packed, Σ_b n_b tokens
in one buffer padded to one of a few static shapes (packed tokens, width), whose step
costs costs.verify_s[j] seconds (calibrated on this hardware: `tree_costs`). For each
shape the allocation is greedy by marginal gain per token: every live row starts at one
node and the upgrades n → next budget (cost: the added nodes; gain: E_b(next) - E_b(n))
are taken best ratio first while they fit the shape; the step takes the shape with the
best Σ_b (1 + E_b(n_b)) / cost. Ratios are made non-increasing along each row's budgets,
so a row's upgrades come in order; for the concave E of trees this is the exact
fractional knapsack, and a prefix of it for the integral one (`tests` compare brute force).

A shape's width bounds every row's budget (its attention runs on the rows padded to that
width). Within a shape whose cost is paid anyway every upgrade that gains anything is
taken, so rows get different budgets where shapes have more tokens than the batch
needs at one width and fewer than at the next, and where rows are not live (they get 0).

That objective is a server's, whose finished rows are refilled. A batch decoded to completion
(`generate`) ends with its slowest row, so there the rows with the most tokens left (`critical`)
decide: their upgrades are taken first, and a shape is worth what its worst critical row
commits, for every live row. On the fixed evaluation set at concurrency 8 the throughput
objective drafted on 40% of steps at a predicted 1.06x AR; its drafted steps committed about
AR's tokens per second, but the rows that accept well finished early and waited, so the
batch took 56 steps against AR's 64 at 1.9 AR steps per drafted step (0.84x AR; 0.975x
with this objective, `benchmarks/results/concurrency_c1_8_32.json`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding.verify_plan import StepCosts, expected_commits


def uniform_shapes(num_slots: int, budgets: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(tokens, width) of the packed shapes whose costs `tree_costs` calibrates: budgets[k]
    nodes for every slot (shape 0: one token per slot, a plain AR step's size)."""
    return tuple((num_slots * n, n) for n in budgets)


FIRST = 2.0  # added to a critical row's upgrade ratios (each <= 1: a node adds <= 1 token) to order them first


def critical_rows(live: jax.Array, remaining: jax.Array) -> jax.Array:
    """bool [B]: the live rows with the most tokens left to decode (remaining [B]), whose
    progress ends a batch decoded to completion (ties all count)."""
    most = jnp.max(jnp.where(live, remaining, jnp.iinfo(jnp.int32).min))
    return live & (remaining >= most)


def allocate(expected: jax.Array, live: jax.Array, budgets: tuple[int, ...],
             shapes: tuple[tuple[int, int], ...], costs: StepCosts, critical: jax.Array | None = None):
    """expected [B, K]: E_b(budgets[k]) (column 0 is 0); live [B]; shapes: (packed tokens,
    width) pairs, ascending, costs.verify_s[j] the step time of shape j. critical [B]
    (`critical_rows`, None: maximise throughput): the makespan's rows; a shape then commits
    #live × (1 + the least E_b of a critical row), as if every row advanced as the slowest.

    Returns (budget per row int32 [B] (0 for rows not live), shape index int32 [],
    expected commits per second of that choice float32 [])."""
    b, k = expected.shape
    sizes = jnp.asarray(budgets, jnp.int32)
    step = (sizes[1:] - sizes[:-1]).astype(jnp.float32)  # nodes added by each upgrade [K-1]
    gain = jnp.maximum(expected[:, 1:] - expected[:, :-1], 0.0)
    ratio = jax.lax.cummin(gain / step[None], axis=1)  # non-increasing along a row's upgrades
    ratio = jnp.where(live[:, None], ratio, -1.0)
    key = ratio if critical is None else jnp.where(critical[:, None] & (ratio > 0), ratio + FIRST, ratio)
    order = jnp.argsort(-key.reshape(-1), stable=True)  # row-major ties: a row's levels in order
    item_row, item_level = order // (k - 1), order % (k - 1) + 1
    item_cost = step[item_level - 1]
    base = jnp.sum(live).astype(jnp.float32)
    useful = ratio.reshape(-1)[order] > 0
    tokens = jnp.asarray([t for t, _ in shapes], jnp.float32)
    widths = jnp.asarray([w for _, w in shapes], jnp.int32)

    def choice(shape):
        # a row's upgrades past the shape's width are skipped (they come after its others)
        eligible = useful & (sizes[item_level] <= widths[shape])
        take = eligible & (jnp.cumsum(jnp.where(eligible, item_cost, 0.0)) <= tokens[shape] - base)
        level = jnp.zeros((b,), jnp.int32).at[item_row].max(jnp.where(take, item_level, 0))
        per_row = 1.0 + jnp.take_along_axis(expected, level[:, None], 1)[:, 0]
        commits = jnp.sum(jnp.where(live, per_row, 0.0))
        if critical is not None:
            slowest = jnp.min(jnp.where(critical, per_row, jnp.inf))
            commits = jnp.where(jnp.any(critical), base * slowest, commits)
        fits = base <= tokens[shape]
        return level, jnp.where(fits, commits / (costs.draft_s + costs.verify_s[shape]), -jnp.inf)

    levels, rates = jax.vmap(choice)(jnp.arange(len(shapes)))  # [J, B], [J]
    best = jnp.argmax(rates).astype(jnp.int32)  # ties go to the smaller shape
    counts = jnp.where(live, sizes[levels[best]], 0)
    return counts.astype(jnp.int32), best, rates[best]


def expected_from_acceptance(p: jax.Array, budgets: tuple[int, ...], block_size: int) -> jax.Array:
    """E_b(n) [B, K] of a chain of min(n, Bs) nodes whose drafts are accepted one after
    another with per-level probability p_b: what a row's running estimate promises before
    drafting (a best-first tree of n nodes does at least as well in expectation)."""
    lengths = jnp.minimum(jnp.asarray(budgets, jnp.float32), float(block_size))
    return expected_commits(p[:, None], lengths[None]) - 1.0


def draft_advantage(p: jax.Array, live: jax.Array, budgets: tuple[int, ...], block_size: int,
                    costs: StepCosts, shapes: tuple[tuple[int, int], ...] | None = None,
                    critical: jax.Array | None = None):
    """(drafts, ratio, step_s): by the rows' running estimates, whether the best allocation
    drafts for some row, its expected commits per second over a plain AR step's (costs.ar_s:
    the AR program's step; verify_s: drafted steps per shape, drafting included), and its
    step's seconds. shapes default to `uniform_shapes`; critical as in `allocate`."""
    shapes = uniform_shapes(p.shape[0], budgets) if shapes is None else shapes
    counts, shape, rate = allocate(expected_from_acceptance(p, budgets, block_size), live, budgets, shapes, costs,
                                   critical)
    ar = jnp.sum(live) / costs.ar_s
    ratio = jnp.where(ar > 0, rate / jnp.maximum(ar, 1e-30), 0.0)
    return jnp.any(counts > 1), ratio, costs.draft_s + costs.verify_s[shape]


DRAFT_MARGIN = 0.1  # drafting must promise this much more than AR steps before it is chosen


def pays(drafts: jax.Array, ratio: jax.Array) -> jax.Array:
    """Whether an advantage `ratio` over AR steps is worth drafting for: above 1 + DRAFT_MARGIN.

    The running estimates' promise is not accurate (on the steps it drafted at concurrency 1
    it promised 1.7-2.9× the drafts accepted: a chain of the budget's length at the per-level
    acceptance of trees, which are wider than deep), and the step costs it is divided by
    are timings that move by ±10% between runs on a busy machine. It only decides whether to
    draft: the drafted step's budgets come from its tree's own expectations, scaled by what
    they delivered (`realized_gain`), so a step entered on too rosy a promise verifies few
    nodes. Scaling the promise itself by what it delivered stopped concurrency 1 from
    drafting on steps that paid (greedy: 2% of its steps drafted, 0.98× AR, against 24%
    and 1.08× without)."""
    return drafts & (ratio > 1.0 + DRAFT_MARGIN)


def drafting_pays(p: jax.Array, live: jax.Array, budgets: tuple[int, ...], block_size: int,
                  costs: StepCosts, shapes: tuple[tuple[int, int], ...] | None = None,
                  critical: jax.Array | None = None) -> jax.Array:
    """True when, by the rows' running estimates, the best allocation drafts for some row and
    beats a plain AR step by the margin (`draft_advantage`, `pays`)."""
    drafts, ratio, _ = draft_advantage(p, live, budgets, block_size, costs, shapes, critical)
    return pays(drafts, ratio)


PROBE_OVERHEAD = 0.03  # the share of decoding time drafted probes may lose, by the rows' own estimates
SHADOW_OVERHEAD = 0.01  # the share of decoding time shadow probes may cost


def drafted_probe_gap(ratio: jax.Array, step_s: jax.Array, costs: StepCosts, backoff: jax.Array) -> jax.Array:
    """Steps of plain AR between drafted probes, when drafting is inside the margin (the
    estimates put it at or above break-even, `ratio` >= 1, but not above 1 + DRAFT_MARGIN).

    A drafted probe is a step of step_s seconds that the estimates say yields `ratio` of
    what AR steps would in that time: it loses step_s·(1 + DRAFT_MARGIN − ratio) seconds,
    counted against the margin drafting must clear (`pays`), so an estimate inside the margin
    is not probed every step. Spread over g AR steps of ar_s, the loss is a PROBE_OVERHEAD
    share when g = step_s·(1 + DRAFT_MARGIN − ratio) / (ar_s·PROBE_OVERHEAD). So an
    estimate just short of paying is re-checked within a few steps, by a step that commits
    what it accepts (at concurrency 1 on the fixed evaluation set the default drafted on
    about half the steps, many of them such probes); never later than the doubling
    `backoff` (`verify_plan.next_probe_gap`)."""
    g = jnp.ceil(step_s * jnp.maximum(1.0 + DRAFT_MARGIN - ratio, 0.0) / (costs.ar_s * PROBE_OVERHEAD))
    return jnp.clip(g, 1, backoff).astype(jnp.int32)


def probe_seconds(costs: StepCosts) -> jax.Array:
    """What a shadow probe adds to an AR step (`shadow_probe`: the drafter's forward and the
    ring's catch-up), bounded above by what the smallest drafted shape (one node per slot:
    an AR step's verify) costs over an AR step, and at least 5% of an AR step."""
    return jnp.maximum(costs.verify_s[0] - costs.ar_s, 0.05 * costs.ar_s)


def probe_gap(costs: StepCosts, backoff: jax.Array) -> jax.Array:
    """Steps of plain AR between shadow probes, when drafting is below break-even by the
    estimates.

    A shadow probe costs `probe_seconds` and commits what an AR step commits, so spread over
    g AR steps its cost is a SHADOW_OVERHEAD share when g = probe_s / (ar_s · SHADOW_OVERHEAD);
    never later than the doubling `backoff` (`verify_plan.next_probe_gap`, which also makes
    the first step of a fresh decoder probe). A drafted probe there would lose (1 − ratio)
    of a drafted step: at concurrency 32 on this CPU, 1.6-1.8 AR steps that committed little
    more than one."""
    g = jnp.ceil(probe_seconds(costs) / (costs.ar_s * SHADOW_OVERHEAD))
    return jnp.clip(g, 1, backoff).astype(jnp.int32)

"""The "auto" node budget of tree verification: per step, the budget with the most expected
committed tokens per second (`generate(verify="tree", tree_budget="auto")`).

Candidate budgets are static (`auto_budgets`: the `TREE_BUDGETS` up to twice the
block size), each with a calibrated step time (`tree_costs`); budget 1 is a plain
AR step that runs no drafter. A step of budget N commits accepted + 1 tokens per
live slot, so the policy maximises Σ_i (E_i(N) + 1) / t(N).

Expected acceptance from the tree itself. Under the drafter's own calibration
(the target's token at depth d is q_d(t), independently of the path), a node is
reached by the greedy walk with the product of the marginals along its path, so
the expected accepted length of a tree is the sum over its drafted nodes of
those path probabilities. Best-first trees are nested: the tree of budget n is
the first n nodes of any larger one, so one build serves every budget and E(n)
is a cumulative sum over node index.

Realized acceptance corrects the drafter through the per-slot feedback counts of
`verify_plan` (the mechanism "auto" uses for chain verification): a step examines
one tree level per accepted node, plus the level where the walk stopped if that
node had children; the drafter predicted each such level's hit with the summed
marginals of the node's children in the verified tree. Each node's marginal is
then moved in log-odds by the slot's `feedback_shift` (for a chain exactly the
chain rule), siblings' corrected marginals are scaled to sum to at most 1.

Whether to draft at all is decided before drafting, from each slot's realized
per-level acceptance p (smoothed towards the drafter's predictions): a chain of
min(N, Bs) nodes, which the best-first tree of budget N beats or equals in
expectation (it has the largest sum of path probabilities of any N-node tree),
would commit Σ_{k<min(N,Bs)} p^k; if no budget beats the AR step this way, the
step is plain AR, with the chain policy's probe schedule (`verify_plan.next_probe_gap`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding import verify_plan
from adaflash_jax.decoding.tree_build import MAX_TREE_BUDGET, TREE_BUDGETS, DraftTree
from adaflash_jax.decoding.verify_plan import StepCosts


def auto_budgets(block_size: int) -> tuple[int, ...]:
    """The budgets "auto" chooses from: 1 (AR) up to twice the block size."""
    return tuple(n for n in TREE_BUDGETS if n <= 2 * block_size)


def tree_budgets(tree_budget, block_size: int) -> tuple[int, ...]:
    """The budgets a tree engine verifies: (N,) for a node count, `auto_budgets` for "auto";
    ValueError for anything else."""
    if tree_budget == "auto":
        return auto_budgets(block_size)
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or not 1 <= tree_budget <= MAX_TREE_BUDGET:
        raise ValueError(f"tree_budget must be an int in [1, {MAX_TREE_BUDGET}] (nodes, root included) or "
                         f"'auto', got {tree_budget!r}")
    return (int(tree_budget),)


def node_log_marginals(tree: DraftTree) -> jax.Array:
    """float32 [B, N]: log q of each drafted node's own token (its score minus its parent's);
    0 at the root, -inf for invalid nodes."""
    parent_scores = jnp.take_along_axis(tree.scores, jnp.maximum(tree.parents, 0), axis=1)
    drafted = tree.valid & (tree.parents >= 0)
    lm = jnp.where(drafted, tree.scores - jnp.where(drafted, parent_scores, 0.0), -jnp.inf)
    return jnp.where(tree.parents < 0, 0.0, jnp.minimum(lm, 0.0))


def _child_sums(tree: DraftTree, values: jax.Array) -> jax.Array:
    """[B, N]: per node, the sum of `values` over its valid children."""
    n = tree.num_nodes
    onehot = jax.nn.one_hot(jnp.where(tree.valid & (tree.parents >= 0), tree.parents, n), n,
                            dtype=values.dtype)  # [B, child, parent]
    return jnp.einsum("bc,bcp->bp", values, onehot)


def expected_accepted(tree: DraftTree, ancestors: jax.Array, shift: jax.Array) -> jax.Array:
    """float32 [B, N]: entry n-1 is the expected accepted length of the tree's first n nodes,
    with every marginal moved by `shift` [B] in log-odds (siblings capped at mass 1)."""
    lm = node_log_marginals(tree)
    drafted = tree.valid & (tree.parents >= 0)
    q = jnp.exp(lm)
    logit = lm - jnp.log1p(-jnp.minimum(q, 1 - 1e-6))
    corrected = jnp.where(drafted, jax.nn.sigmoid(logit + shift[:, None]), 0.0)
    mass = _child_sums(tree, corrected)
    parent_mass = jnp.take_along_axis(mass, jnp.maximum(tree.parents, 0), axis=1)
    corrected = corrected / jnp.maximum(parent_mass, 1.0)
    log_c = jnp.where(drafted, jnp.log(jnp.maximum(corrected, 1e-30)), 0.0)
    path_p = jnp.exp(jnp.einsum("bij,bj->bi", ancestors.astype(jnp.float32), log_c))
    return jnp.cumsum(jnp.where(drafted, path_p, 0.0), axis=1)


def level_feedback(tree: DraftTree, path: jax.Array, accepted: jax.Array):
    """(examined [B], predicted [B]) of one greedy or sampled walk over `tree`: the levels whose
    outcome the step observed and the drafter's summed predicted hit probability over them."""
    drafted = tree.valid & (tree.parents >= 0)
    child_p = jnp.minimum(_child_sums(tree, jnp.where(drafted, jnp.exp(node_log_marginals(tree)), 0.0)), 1.0)
    has_child = _child_sums(tree, drafted.astype(jnp.float32)) > 0
    on_path = jnp.arange(path.shape[1])[None] <= accepted[:, None]
    predicted = jnp.sum(jnp.where(on_path, jnp.take_along_axis(child_p, path, axis=1), 0.0), axis=1)
    last = jnp.take_along_axis(path, accepted[:, None], axis=1)[:, 0]
    stopped_at_children = jnp.take_along_axis(has_child, last[:, None], axis=1)[:, 0]
    return accepted + stopped_at_children.astype(jnp.int32), predicted


def budget_expectations(cum: jax.Array, budgets: tuple[int, ...]) -> jax.Array:
    """float32 [B, K]: expected accepted per budget, from the cumulative sums [B, N] of one
    best-first build of the largest budget (budget n is its first n nodes)."""
    cols = [jnp.zeros(cum.shape[:1], jnp.float32) if n == 1 else cum[:, n - 1] for n in budgets]
    return jnp.stack(cols, axis=1)


def drafted_choice(expected: jax.Array, live: jax.Array, budgets: tuple[int, ...], costs: StepCosts):
    """(budget index, expected commits per second) of the best drafted budget (>= 2), given the
    tree's expectations [B, K]. costs.verify_s[k] is the step time of budget k."""
    commits = jnp.sum(jnp.where(live[:, None], expected + 1.0, 0.0), axis=0)
    rates = commits / (costs.draft_s + costs.verify_s)
    rates = jnp.where(jnp.asarray(budgets) >= 2, rates, -jnp.inf)
    best = jnp.argmax(rates).astype(jnp.int32)
    return best, rates[best]


def drafting_pays(p: jax.Array, live: jax.Array, budgets: tuple[int, ...], block_size: int,
                  costs: StepCosts) -> jax.Array:
    """True when, by each slot's per-level acceptance p, some drafted budget beats the AR step."""
    lengths = jnp.minimum(jnp.asarray(budgets, jnp.float32), float(block_size))
    commits = jnp.sum(jnp.where(live[:, None], verify_plan.expected_commits(p[:, None], lengths[None]), 0.0),
                      axis=0)
    rates = jnp.where(jnp.asarray(budgets) >= 2, commits / (costs.draft_s + costs.verify_s), -jnp.inf)
    return jnp.max(rates) > verify_plan.ar_rate(live, costs)


def realized_acceptance(hits: jax.Array, trials: jax.Array, predicted: jax.Array, prior_trials) -> jax.Array:
    """float32 [B]: per-level acceptance r = (hits + k0·h) / (trials + k0), h the drafter's
    predicted rate over the same levels (0 for a slot without observations)."""
    seen = trials > 0
    h = jnp.where(seen, predicted / jnp.where(seen, trials, 1.0), 0.0)
    return jnp.where(seen, (hits + prior_trials * h) / jnp.maximum(trials + prior_trials, 1e-9), 0.0)

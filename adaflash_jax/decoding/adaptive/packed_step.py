"""The adaptive decoder's drafted step: draft -> per-row budgets -> packed tree verify -> accept.

One drafter forward and one best-first build of the largest budget give every row its
tree; each row's expected accepted length per budget comes from the tree's own path
probabilities, corrected by the row's realized acceptance (`tree_policy`). `allocation`
then gives each row its own budget, and the rows' nodes are verified packed, Σ_b n_b
tokens in one buffer (`TargetLM.packed_tree_forward`), in the compiled branch of the
shape that holds them: under load a row whose drafts do not pay verifies only its root
and costs one token, while a row whose drafts do gets a deep tree. The branches only
read the caches; the accepted paths are written once, after the switch (`commit_tree`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding import tree_policy, verify_plan
from adaflash_jax.decoding.adaptive.allocation import allocate, critical_rows, drafting_pays, uniform_shapes
from adaflash_jax.decoding.adaptive.realized_gain import gain_of
from adaflash_jax.decoding.engine_state import DecodeState
from adaflash_jax.decoding.sampling import checked_log_probs
from adaflash_jax.decoding.tree_build import DraftTree, ancestor_mask
from adaflash_jax.decoding.tree_step import (TreeOutcome, accept_tree, commit_tree, draft_tree, padded,
                                             tree_depth, with_feedback)
from adaflash_jax.models.packed_layout import PackedLayout, pack_layout


def verify_packed_tree(cfg, target, drafter, state: DecodeState, tree: DraftTree, ancestors: jax.Array,
                       layout: PackedLayout) -> TreeOutcome:
    """Verifies each row's first layout.lengths[b] nodes of `tree` [B, W] (nodes past them
    invalid) packed, and accepts a path per row; the LM head runs on the packed nodes only."""
    p = state.params
    out = target.packed_tree_forward(layout.pack(tree.tokens), layout.pack(tree.depths), layout, ancestors,
                                     state.tcache, feature_layers=drafter.cfg.target_layer_ids,
                                     attn_impl=cfg.attn_impl)
    if cfg.greedy:
        scores, finite = layout.unpack(target.greedy_tokens(out.hidden, cfg.attn_impl)), None
    else:
        rows = layout.seq_ids
        logp, packed_finite = checked_log_probs(target.logits(out.hidden), p.temperature[rows][:, None],
                                                p.top_p[rows][:, None])
        slot, finite = layout.row_start, layout.unpack(packed_finite)

        def scores(cur):  # node cur[b] of row b sits at packed slot row_start[b] + cur[b]
            return logp[jnp.clip(slot + cur, 0, logp.shape[0] - 1)]
    return accept_tree(cfg, state, tree, scores, layout.unpack(out.features), out.node_k, out.node_v, finite)


def truncated(tree: DraftTree, counts: jax.Array, width: int) -> DraftTree:
    """The first `width` nodes of each row's tree, those at or past counts[b] invalid
    (best-first order: any prefix of a tree is a tree)."""
    keep = jnp.arange(width)[None] < counts[:, None]
    return DraftTree(*(x[:, :width] for x in tree[:-1]), tree.valid[:, :width] & keep)


def engine_shapes(num_slots: int, budgets: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The packed shapes (tokens, width) the adaptive step compiles: every budget for every
    slot (`uniform_shapes`) and, from 4 slots on, two shapes for load, a quarter of the slots'
    worth of extra nodes at width 4 and half at width 8, so a few rows can draft deep while
    the others verify their root alone."""
    shapes = set(uniform_shapes(num_slots, budgets))
    if num_slots >= 4:
        deepest = max(budgets)
        shapes |= {(num_slots + num_slots // 4, min(4, deepest)), (num_slots + num_slots // 2, min(8, deepest))}
    return tuple(sorted(shapes))


def makespan_rows(cfg, state: DecodeState) -> jax.Array | None:
    """The rows the allocation favours under cfg.objective "makespan" (`allocation.critical_rows`:
    the live rows with the most tokens left), None under "throughput"."""
    if cfg.objective != "makespan":
        return None
    return critical_rows(~state.done, state.params.max_new - state.num_out)


def estimates_pay(cfg, state: DecodeState):
    """p_est [S] -> whether drafting pays for `state`'s live rows by those estimates
    (`allocation.drafting_pays` over the engine's shapes and the objective's rows): the
    probe schedule's test after feedback."""
    shapes, costs, live, critical = (engine_shapes(state.num_slots, cfg.buckets), state.plan.costs, ~state.done,
                                     makespan_rows(cfg, state))
    return lambda p_est: drafting_pays(p_est, live, cfg.buckets, cfg.block_size, costs, shapes, critical)


def draft_and_expect(cfg, target, drafter, state: DecodeState):
    """The largest best-first tree of every row, its ancestor mask and each row's expected
    accepted length per budget [S, K] (the drafter's path probabilities, feedback-corrected)."""
    policy = state.policy
    tree = draft_tree(cfg, target, drafter, state, max(cfg.buckets))
    mask = ancestor_mask(tree, tree_depth(cfg.block_size, max(cfg.buckets)))
    shift = verify_plan.feedback_shift(policy.hits, policy.trials, policy.predicted, state.plan.prior_trials)
    return tree, mask, tree_policy.budget_expectations(tree_policy.expected_accepted(tree, mask, shift),
                                                       cfg.buckets)


def adaptive_step(cfg, target, drafter, state: DecodeState) -> tuple[DecodeState, jax.Array]:
    """One drafted step with per-row budgets (cfg: the adaptive decoder's tree config), and
    the seconds the plan's costs predict for it. The budgets are chosen on the expectations
    times the realized-gain factor; the uncorrected expectation of each row's budget is what
    the step's outcome is held against (`realized_gain`)."""
    tree, mask, expected = draft_and_expect(cfg, target, drafter, state)
    shapes, costs = engine_shapes(state.num_slots, cfg.buckets), state.plan.costs
    counts, shape, _ = allocate(gain_of(state.policy) * expected, ~state.done, cfg.buckets, shapes, costs,
                                makespan_rows(cfg, state))
    level = jnp.argmax(counts[:, None] == jnp.asarray(cfg.buckets)[None], axis=1)
    promised = jnp.take_along_axis(expected, level[:, None], axis=1)[:, 0]
    return (verify_and_commit(cfg, target, drafter, state, tree, mask, counts, shape, promised),
            costs.draft_s + costs.verify_s[shape])


def verify_and_commit(cfg, target, drafter, state: DecodeState, tree: DraftTree, mask: jax.Array,
                      counts: jax.Array, shape: jax.Array, promised: jax.Array | None = None) -> DecodeState:
    """Verifies counts[b] nodes of each row's tree packed in `engine_shapes`[shape] (one
    compiled branch per shape, reading the caches only), then commits and learns: the rows'
    feedback, and with `promised` [S] (each row's expected accepted drafts for its budget)
    the realized-gain sums."""
    budgets = cfg.buckets
    width = tree_depth(cfg.block_size, max(budgets)) + 1

    def branch(tokens: int, n: int):
        def run(st):
            sub = truncated(tree, counts, n)
            layout = pack_layout(counts, tokens, n)
            outcome = verify_packed_tree(cfg, target, drafter, st, sub, mask[:, :n, :n], layout)
            examined, predicted = tree_policy.level_feedback(sub, outcome.path, outcome.accepted)
            return padded(outcome._replace(path=None), width), examined, predicted
        return run

    shapes = engine_shapes(state.num_slots, budgets)
    outcome, examined, predicted = jax.lax.switch(shape, [branch(t, n) for t, n in shapes], state)
    new = commit_tree(drafter, state, outcome, True)
    accepted, examined, predicted = root_only_feedback(tree, counts, outcome, examined, predicted)
    new = with_feedback(new, state, jnp.bool_(True), accepted, examined, predicted, estimates_pay(cfg, state))
    if promised is None or state.policy.gain is None:
        return new
    gain = state.policy.gain.observe(outcome.accepted, promised, ~state.done & (counts >= 2))
    return new.replace(policy=new.policy.replace(gain=gain))


def root_only_feedback(tree: DraftTree, counts, outcome: TreeOutcome, examined, predicted):
    """(accepted, examined, predicted) feedback per row. A row that verified its root alone
    still learns something: the target's token after the root is what a budget of 2 would
    have checked against the drafter's best first child (node 1 of a best-first tree), so
    its hit and the drafter's probability of it count as one examined level. Without this a
    row given one node would never correct an underconfident drafter and never draft again."""
    solo = counts == 1
    hit = tree.valid[:, 1] & (tree.tokens[:, 1] == outcome.emitted[:, 0])
    q1 = jnp.where(tree.valid[:, 1], jnp.exp(tree.scores[:, 1]), 0.0)  # the root's score is 0
    return (jnp.where(solo, hit.astype(jnp.int32), outcome.accepted), jnp.where(solo, 1, examined),
            jnp.where(solo, jnp.minimum(q1, 1.0), predicted))

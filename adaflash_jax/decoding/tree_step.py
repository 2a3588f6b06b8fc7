"""The tree step of the engine: draft -> build tree -> verify tree -> accept -> compact -> commit.

One drafter forward gives a distribution at every block offset; instead of
verifying only its argmax chain, the step verifies a best-first tree of
`tree_budget` nodes (`tree_build`) in one target forward, each node at
position L + depth and seeing the committed cache plus its ancestors. The
acceptance rules of `tree_accept` pick a path (greedy: the target's argmax;
T > 0: recursive rejection over siblings, lossless). The nodes' K/V come
back per node; only the accepted path's are written, at the
contiguous slots L + depth (compaction), and its target features go into the
drafter's context at the same positions, so after `commit` both caches look
exactly as if the accepted tokens had been decoded one by one. Verification
only reads the caches, so the "auto" policy's per-budget branches do not copy
them (XLA copies a buffer a conditional branch writes in place: at a
512-token SmolLM2 cache that was four full-cache copies per step).
A budget of 1 is a plain AR step (the tree is the root alone, no drafting).
Under the "auto" policy (`tree_policy`) every step picks its budget: one
best-first build of the largest budget, whose prefixes are the trees of every
smaller budget, then one compiled branch per budget.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from adaflash_jax.decoding import tree_policy, verify_plan
from adaflash_jax.decoding.engine_state import DecodeState, commit
from adaflash_jax.decoding.acceptance import stop_at_nonfinite
from adaflash_jax.decoding.sampling import checked_log_probs, stream_keys
from adaflash_jax.decoding.tree_accept import (path_tokens, tree_coupled_accept, tree_greedy_accept,
                                               tree_sample_accept)
from adaflash_jax.decoding.tree_build import DraftTree, ancestor_mask, build_tree, chain_tree
from adaflash_jax.models import draft_vocab
from adaflash_jax.models.drafter import append_context, draft_block
from adaflash_jax.models.kv_cache import path_entries


def draft_log_probs(target, drafter, block_hidden: jax.Array, temperature=None) -> jax.Array:
    """The drafter's log q_d over its draft vocabulary [B, Bs-1, K] (K = V without a reduced
    one: `draft_vocab.d2t_or_none` maps columns to token ids) at offsets 1..Bs-1: the tree's
    scores. Outside a reduced vocabulary q is zero, so scoring only its K columns builds the
    same tree as the full vocabulary, at K/V of the cost. At T > 0 (temperature [B]) q is
    tempered like the target's distribution; the tree's shape affects speed only, never the
    output."""
    logits = draft_vocab.logits(target, drafter, block_hidden[:, 1:])
    if temperature is not None:
        logits = logits / temperature[:, None, None]
    return jax.nn.log_softmax(logits, axis=-1)


def tree_depth(block_size: int, budget: int) -> int:
    """The deepest node a tree can hold: a block offset (<= Bs-1) and a path within the budget."""
    return min(block_size - 1, budget - 1)


def tree_step(cfg, target, drafter, state: DecodeState) -> DecodeState:
    """One tree-verification step for every live slot (cfg: an `engine_state.EngineConfig`
    with verify="tree"). The target cache must have room for tree_budget slots past every
    committed length (`generate` sizes it so). policy "auto" chooses the budget per step
    (`tree_policy`); otherwise every step verifies tree_budget nodes."""
    if cfg.policy == "auto":
        return tree_auto_step(cfg, target, drafter, state)
    n = cfg.tree_budget
    if n > 1:
        tree = draft_tree(cfg, target, drafter, state, n)
    else:
        tree = chain_tree(state.bonus, jnp.zeros((state.num_slots, 0), jnp.int32))
    outcome = verify_tree(cfg, target, drafter, state, tree, ancestor_mask(tree, tree_depth(cfg.block_size, n)))
    return commit_tree(drafter, state, outcome, n > 1)


def draft_log_probs_of(cfg, target, drafter, state: DecodeState) -> jax.Array:
    """The drafter's block from the slots' bonus tokens -> its log q_d [S, Bs-1, V] (tempered at T > 0)."""
    hidden = draft_block(drafter, target.embed_tokens, state.bonus, state.ctx, attn_impl=cfg.attn_impl)
    return draft_log_probs(target, drafter, hidden, None if cfg.greedy else state.params.temperature)


def draft_tree(cfg, target, drafter, state: DecodeState, n: int) -> DraftTree:
    """The step's best-first tree of n nodes."""
    return build_tree(draft_log_probs_of(cfg, target, drafter, state), state.bonus, n,
                      draft_vocab.d2t_or_none(drafter))


class TreeOutcome(NamedTuple):
    """What verifying a tree decides, before anything is written: the accepted path's K/V and
    target features (W entries from its root, W >= accepted + 1; entries past the accepted
    path are never committed), the tokens to emit and the counts."""

    path_k: jax.Array  # [L, S, Hkv, W, Dh]
    path_v: jax.Array
    path_features: jax.Array  # [S, W, kD]
    emitted: jax.Array  # [S, block_size]
    accepted: jax.Array  # [S]
    verified: jax.Array  # [S]
    path: jax.Array  # [S, depth + 1] node indices


def verify_tree(cfg, target, drafter, state: DecodeState, tree: DraftTree, ancestors: jax.Array) -> TreeOutcome:
    """Verifies `tree` (ancestors: its `ancestor_mask`) in one target forward and accepts a
    path. Reads the caches only (`commit_tree` writes them)."""
    p = state.params
    verify = target.tree_forward(tree.tokens, tree.depths, ancestors, state.tcache,
                                 feature_layers=drafter.cfg.target_layer_ids, attn_impl=cfg.attn_impl)
    if cfg.greedy:
        scores, finite = target.greedy_tokens(verify.hidden, cfg.attn_impl), None
    else:
        scores, finite = checked_log_probs(target.logits(verify.hidden), p.temperature[:, None, None],
                                           p.top_p[:, None, None])
    return accept_tree(cfg, state, tree, scores, verify.features, verify.node_k, verify.node_v, finite)


def accept_tree(cfg, state: DecodeState, tree: DraftTree, scores, features: jax.Array, node_k: jax.Array,
                node_v: jax.Array, finite: jax.Array | None = None) -> TreeOutcome:
    """The acceptance rule over a verified tree and what it keeps. scores: greedy, the
    target's argmax at every node [B, N] (-1 where the logits were not finite); T > 0, its
    log-probs [B, N, V], or a function of the current node [B] -> [B, V] (`tree_accept`), and
    finite bool [B, N], whether each node's logits were (the path stops at the first that was
    not, `acceptance.stop_at_nonfinite`); features [B, N, kD] and node_k/v [L, B, Hkv, N, Dh]
    per node."""
    p = state.params
    depth = tree_depth(cfg.block_size, tree.num_nodes)
    if cfg.greedy:
        path, accepted, nxt = tree_greedy_accept(tree, scores, depth)
    elif cfg.coupled_sampling:
        path, accepted, nxt = tree_coupled_accept(
            tree, scores, lambda lvl: stream_keys(p.seed_key, p.stream, state.num_out + lvl), depth)
    else:
        path, accepted, nxt = tree_sample_accept(tree, scores, stream_keys(p.seed_key, p.stream, state.num_out),
                                                 depth)
    if not cfg.greedy:  # path[:, d] is the node whose distribution gave the token at depth d + 1
        accepted, nxt = stop_at_nonfinite(accepted, nxt, jnp.take_along_axis(finite, path, axis=1))
    emitted = path_tokens(tree, path, accepted, nxt)
    if emitted.shape[1] < cfg.block_size:  # every budget commits through one output width
        emitted = jnp.pad(emitted, ((0, 0), (0, cfg.block_size - emitted.shape[1])))
    return TreeOutcome(*path_entries(node_k, node_v, path), jnp.take_along_axis(features, path[..., None], axis=1),
                       emitted, accepted, jnp.where(state.done, 0, jnp.sum(tree.valid, axis=1, dtype=jnp.int32)),
                       path)


def padded(outcome: TreeOutcome, width: int) -> TreeOutcome:
    """The outcome with its path entries padded to `width` (one output shape for every
    branch of a `lax.switch`)."""
    pad = width - outcome.path_k.shape[3]
    kv = ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0))
    return outcome._replace(path_k=jnp.pad(outcome.path_k, kv), path_v=jnp.pad(outcome.path_v, kv),
                            path_features=jnp.pad(outcome.path_features, ((0, 0), (0, pad), (0, 0))))


def commit_tree(drafter, state: DecodeState, outcome: TreeOutcome, drafted) -> DecodeState:
    """Writes the accepted path's K/V at the contiguous positions after each slot's committed
    length (compaction), its features into the drafter's context there, and commits."""
    lengths = state.tcache.lengths
    tcache = state.tcache.write(outcome.path_k, outcome.path_v, lengths)
    positions = lengths[:, None] + jnp.arange(outcome.path_features.shape[1], dtype=jnp.int32)[None]
    ctx = append_context(drafter, state.ctx, outcome.path_features, positions)
    return commit(state, outcome.emitted, outcome.accepted, tcache, ctx,
                  outcome.verified, drafted)


def root_tree(roots: jax.Array, n: int) -> DraftTree:
    """A tree of n nodes holding only its root (the rest invalid): what an undrafted step verifies."""
    b = roots.shape[0]
    first = jnp.arange(n)[None] == 0
    return DraftTree(jnp.where(first, roots[:, None], 0).astype(jnp.int32), jnp.full((b, n), -1, jnp.int32),
                     jnp.zeros((b, n), jnp.int32),
                     jnp.broadcast_to(jnp.where(first, 0.0, -jnp.inf), (b, n)).astype(jnp.float32),
                     jnp.broadcast_to(first, (b, n)))


def _prefix(tree: DraftTree, n: int) -> DraftTree:
    return DraftTree(*(x[:, :n] for x in tree))


def tree_auto_step(cfg, target, drafter, state: DecodeState) -> DecodeState:
    """One step under the "auto" budget policy (`tree_policy`): decide whether to draft, build
    the largest tree once (its prefixes are the smaller ones), pick the budget with the most
    expected commits per second, verify that prefix (one compiled branch per budget) and fold
    the outcome into the slots' feedback."""
    budgets, bs = cfg.buckets, cfg.block_size
    plan, policy, live = state.plan, state.policy, ~state.done
    largest = max(budgets)
    pays = tree_policy.drafting_pays(policy.p_est, live, budgets, bs, plan.costs)
    draft_now = pays | (policy.since_draft >= policy.probe_gap)

    tree = jax.lax.cond(draft_now, lambda: draft_tree(cfg, target, drafter, state, largest),
                        lambda: root_tree(state.bonus, largest))
    mask = ancestor_mask(tree, tree_depth(bs, largest))
    shift = verify_plan.feedback_shift(policy.hits, policy.trials, policy.predicted, plan.prior_trials)
    expected = tree_policy.budget_expectations(tree_policy.expected_accepted(tree, mask, shift), budgets)
    k_drafted, _ = tree_policy.drafted_choice(expected, live, budgets, plan.costs)
    k = jnp.where(draft_now, k_drafted, 0)
    width = tree_depth(bs, largest) + 1

    def branch(n: int):
        def run(st):
            prefix = _prefix(tree, n)
            outcome = verify_tree(cfg, target, drafter, st, prefix, mask[:, :n, :n])
            examined, predicted = tree_policy.level_feedback(prefix, outcome.path, outcome.accepted)
            return padded(outcome._replace(path=None), width), examined, predicted
        return run

    # the branches only read the caches; the write happens once, after the switch
    outcome, examined, predicted = jax.lax.switch(k, [branch(n) for n in budgets], state)
    new = commit_tree(drafter, state, outcome, k > 0)
    return with_feedback(new, state, draft_now, outcome.accepted, examined, predicted,
                         lambda p_est: tree_policy.drafting_pays(p_est, live, budgets, bs, plan.costs))


def with_feedback(new: DecodeState, state: DecodeState, drafted, accepted, examined, predicted,
                  pays) -> DecodeState:
    """`new` (the committed step) with the policy state updated by what the step observed:
    each live slot's acceptance counts and estimate, and the probe schedule (pays: the new
    estimates [S] -> whether drafting pays)."""
    plan, policy = state.plan, state.policy
    policy = folded_feedback(policy, plan, accepted, examined, predicted, drafted & ~state.done & (examined > 0))
    return new.replace(policy=policy.replace(
        since_draft=jnp.where(drafted, 0, policy.since_draft + 1).astype(jnp.int32),
        probe_gap=verify_plan.next_probe_gap(drafted, pays(policy.p_est), policy.probe_gap, plan.probe_every)))


def folded_feedback(policy, plan, accepted, examined, predicted, seen):
    """`policy` with one observation per row in `seen` (accepted / examined levels and the
    drafter's predicted hits over them) folded into its counts, and those rows' estimates
    recomputed from the counts (`tree_policy.realized_acceptance`)."""
    hits, trials, predicted = verify_plan.fold_feedback(policy.hits, policy.trials, policy.predicted, accepted,
                                                        examined, predicted, seen, plan.feedback_decay)
    p_est = jnp.where(seen, tree_policy.realized_acceptance(hits, trials, predicted, plan.prior_trials),
                      policy.p_est)
    return policy.replace(p_est=p_est, hits=hits, trials=trials, predicted=predicted)

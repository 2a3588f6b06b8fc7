"""Draft trees built from one drafter forward (DDTree-style tree verification).

A block-diffusion drafter gives a full distribution q_d at every block offset
d = 1..Bs-1 in one pass, so more than one continuation can be verified at
once: the target checks a tree of candidate tokens instead of a single chain.

The tree of a row is static-shaped: N nodes (the node budget), node 0 the
root (the bonus token, at depth 0), node i > 0 holding token `tokens[i]` at
depth `depths[i]` (1..Bs-1) under `parents[i]` < i. A node's path score is the
sum of the drafter's log-marginals log q_d(token) along its path from the root.
Nodes are added best-first by path score: node i is the highest-scoring child
not yet in the tree of any node already in it. Log-probabilities are <= 0, so a
child never outscores its parent and the N-1 drafted nodes are exactly the N-1
best-scoring paths of depth <= Bs-1 (nodes appear in descending score order).
The greedy chain is the special case of one node per depth. Nodes that cannot be
filled (every remaining candidate has probability 0, e.g. outside a reduced
draft vocabulary) are marked invalid.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Node budgets the engine compiles for (static shapes): one program per budget.
TREE_BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_TREE_BUDGET = max(TREE_BUDGETS)  # nodes per tree (root included) accepted anywhere


class DraftTree(NamedTuple):
    """A batch of draft trees, each [B, N]; node 0 of each row is its root."""

    tokens: jax.Array  # int32: the node's token (the root's is the bonus token)
    parents: jax.Array  # int32: parent node index (< own index), -1 for the root
    depths: jax.Array  # int32: 0 for the root, 1.. for drafted nodes
    scores: jax.Array  # float32: path score, sum of the drafter's log-marginals (0 at the root)
    valid: jax.Array  # bool: False for nodes the budget could not fill

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def build_tree(draft_log_probs: jax.Array, roots: jax.Array, num_nodes: int,
               token_ids: jax.Array | None = None) -> DraftTree:
    """Best-first trees of `num_nodes` nodes (root included) per row.

    draft_log_probs: float [B, D, V], the drafter's log q_d at block offsets d = 1..D
    (index d-1); roots: int [B], the bonus tokens. token_ids: int [V], the token id of
    each column (a reduced draft vocabulary's d2t, ascending, so ties keep their order);
    None: column j is token j. Each of the N-1 steps adds the
    best frontier candidate; a node's next candidate is its best child not yet added,
    so the frontier has one entry per node and a step costs O(N). Ties go to the
    lower node index, then to the higher-ranked token.

    The tree need not hold the whole argmax chain: deep chain nodes score low, and
    spending the budget on alternatives near the root accepts more (measured with the
    shipped drafter: 16 best-first nodes τ 1.98 against 1.62 for the 16-token chain).
    """
    if num_nodes < 1:
        raise ValueError(f"a tree needs at least its root node, got num_nodes={num_nodes}")
    _, _, v = draft_log_probs.shape
    k = max(1, min(num_nodes - 1, v))  # no node can have more than N-1 children in the tree
    top_lp, top_ids = jax.lax.top_k(draft_log_probs.astype(jnp.float32), k)  # [B, D, K] per offset
    if token_ids is not None:
        top_ids = jnp.take(token_ids, top_ids)
    return jax.vmap(lambda lp, ids, r: _build_one(lp, ids, r, num_nodes))(top_lp, top_ids, roots)


def _build_one(top_lp: jax.Array, top_ids: jax.Array, root: jax.Array, n: int) -> DraftTree:
    """One row: top_lp/top_ids [D, K] are each offset's K best tokens, best first."""
    d, k = top_lp.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    tokens = jnp.zeros((n,), jnp.int32).at[0].set(root)
    parents = jnp.full((n,), -1, jnp.int32)
    depths = jnp.zeros((n,), jnp.int32)
    scores = jnp.full((n,), -jnp.inf, jnp.float32).at[0].set(0.0)
    next_rank = jnp.zeros((n,), jnp.int32)  # rank of each node's best child not yet in the tree

    def add(i, carry):
        tokens, parents, depths, scores, next_rank = carry
        open_ = (idx < i) & (depths < d) & (next_rank < k) & jnp.isfinite(scores)
        row, col = jnp.minimum(depths, d - 1), jnp.minimum(next_rank, k - 1)
        cand = jnp.where(open_, scores + top_lp[row, col], -jnp.inf)
        p = jnp.argmax(cand).astype(jnp.int32)
        ok = jnp.isfinite(cand[p])
        tokens = tokens.at[i].set(jnp.where(ok, top_ids[row[p], col[p]], 0))
        parents = parents.at[i].set(jnp.where(ok, p, -1))
        depths = depths.at[i].set(jnp.where(ok, depths[p] + 1, 0))
        scores = scores.at[i].set(cand[p])
        next_rank = next_rank.at[p].add(ok.astype(jnp.int32))
        return tokens, parents, depths, scores, next_rank

    tokens, parents, depths, scores, _ = jax.lax.fori_loop(
        1, n, add, (tokens, parents, depths, scores, next_rank))
    return DraftTree(tokens, parents, depths, scores, jnp.isfinite(scores))


def chain_tree(roots: jax.Array, drafts: jax.Array) -> DraftTree:
    """The greedy chain [root, d_1, .., d_{Bs-1}] as a tree (node i's parent is i-1)."""
    b, n = roots.shape[0], drafts.shape[1] + 1
    idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (b, n))
    return DraftTree(jnp.concatenate([roots[:, None], drafts], axis=1).astype(jnp.int32), idx - 1, idx,
                     jnp.zeros((b, n), jnp.float32), jnp.ones((b, n), bool))


def ancestor_mask(tree: DraftTree, max_depth: int) -> jax.Array:
    """bool [B, N, N]: [b, i, j] is True iff node j is node i or one of its ancestors.

    Pointer jumping along parents, `max_depth` hops (the tree's depth bound, Bs-1).
    Invalid nodes see only themselves.
    """
    b, n = tree.parents.shape
    own = jnp.broadcast_to(jnp.eye(n, dtype=bool)[None], (b, n, n))
    parents = jnp.where(tree.valid, tree.parents, -1)

    def hop(_, carry):
        mask, cur = carry
        live = cur >= 0
        mask = mask | (jax.nn.one_hot(jnp.maximum(cur, 0), n, dtype=bool) & live[..., None])
        return mask, jnp.where(live, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1)

    mask, _ = jax.lax.fori_loop(0, max_depth, hop, (own, parents))
    return mask


def children_mask(tree: DraftTree, node: jax.Array) -> jax.Array:
    """bool [B, N]: the valid children of node[b] in row b."""
    return tree.valid & (tree.parents == node[:, None])


VERIFY_MODES = ("chain", "tree")


def check_tree_settings(cfg) -> None:
    """Raises ValueError for an `engine_state.EngineConfig` whose verify / tree_budget don't fit."""
    if cfg.verify not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {cfg.verify!r}; choose one of {VERIFY_MODES}")
    if cfg.verify == "chain":
        if cfg.tree_budget != 0:
            raise ValueError("tree_budget is for verify='tree'; leave it 0 for chain verification")
        if cfg.coupled_sampling:
            raise ValueError("coupled_sampling is a tree acceptance rule; it needs verify='tree'")
        return
    if cfg.drafter_def is None:
        raise ValueError("verify='tree' needs a drafter")
    if not isinstance(cfg.tree_budget, int) or cfg.tree_budget < 1:
        raise ValueError(f"verify='tree' needs tree_budget >= 1 (nodes, root included), got {cfg.tree_budget!r}")
    if cfg.policy == "auto":  # the budget per step from cfg.buckets (`tree_policy`), at most tree_budget
        budgets = tuple(cfg.buckets)
        if not budgets or budgets[0] != 1 or list(budgets) != sorted(set(budgets)) or budgets[-1] != cfg.tree_budget:
            raise ValueError(f"the 'auto' tree budget needs ascending budgets from 1 up to tree_budget, "
                             f"got {budgets} and {cfg.tree_budget}")
    elif cfg.policy != "fixed":
        raise ValueError(f"verify='tree' sizes verification by tree_budget; length policy {cfg.policy!r} "
                         "does not apply")
    if cfg.sample_drafts or cfg.use_verify_head:
        raise ValueError("verify='tree' verifies a best-first tree of the drafter's distributions; "
                         "sample_drafts and use_verify_head do not apply")

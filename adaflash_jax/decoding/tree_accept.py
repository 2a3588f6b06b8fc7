"""Acceptance over a verified draft tree (`tree_build.DraftTree`): greedy and lossless sampling.

Both rules walk the tree from the root. At the current node (whose target
distribution p, computed with exactly the node's ancestors as context, is the
target's distribution of the next token) they either move to one child, whose
token is then emitted, or stop and emit one token of their own. The walk
returns the accepted path (node indices by depth), its length a (drafted nodes
accepted) and the stop token, so a step commits a + 1 tokens, as a chain does.

Greedy: move to the child whose token is the target's argmax at the node;
stop with the argmax when no child carries it. Output equals greedy AR decoding.

Sampling (T > 0), recursive rejection over siblings (SpecInfer; multi-draft
speculative sampling) with the tree's deterministic candidates. At a node with
target distribution p and children tokens c_1..c_m (distinct, in tree order,
all fixed by the drafter before any random draw), for i = 1..m:

    accept c_i with probability  r_i = p(c_i) / (1 - S_{i-1}),  S_i = p(c_1) + .. + p(c_i)

(r_i = p_{i-1}(c_i), where p_{i-1} = p with c_1..c_{i-1} removed and renormalised:
the residual norm(max(0, p_{i-2} - q_{i-1})) of recursive rejection when each
draft distribution q_j is the point mass on c_j, and min(1, p_{i-1}(c_i) /
q_i(c_i)) = p_{i-1}(c_i)). The first accepted c_i is emitted and the walk
continues at that child; if every child is rejected, emit x drawn from
p_m(x) = p(x) / (1 - S_m) for x not among the children, and stop.

Proof that the emitted token X is distributed as p. The chance of rejecting
c_1..c_{i-1} telescopes: prod_{j<i} (1 - p(c_j)/(1 - S_{j-1}))
= prod_{j<i} (1 - S_j)/(1 - S_{j-1}) = 1 - S_{i-1}. Hence P(X = c_i) =
(1 - S_{i-1}) * p(c_i)/(1 - S_{i-1}) = p(c_i), and for x outside the children
P(X = x) = (1 - S_m) * p(x)/(1 - S_m) = p(x). (Where 1 - S_{i-1} = 0, p(c_i) =
0 and r_i = 0; where 1 - S_m = 0 the final branch has probability 0.) The
draws at each depth are fresh, and the next node's p is the target's
distribution given the emitted prefix, so by induction over depth every
emitted sequence, the stop token included, has the target's own joint
distribution: tree speculation at T > 0 is lossless, whatever tree the drafter
proposed. With m = 1 this is the chain rule for argmax drafts ("sample from p,
accept on match"), and the whole rule equals sampling X ~ p and following the
child that carries X, drawn sibling by sibling.

Randomness: level l of the walk uses `fold_in(key, l)`, key being the slot's
step key (`sampling.stream_keys` of seed, stream and output position), so a
result depends only on the request's seed, stream and position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding.tree_build import DraftTree, children_mask


def _walk(tree: DraftTree, max_depth: int, choose):
    """Follows `choose(level, cur) -> (found [B], child [B], stop_token [B])` from the root.

    Returns (path int [B, max_depth + 1]: node at each depth of the accepted path, entries
    past `accepted` repeat its last node; accepted int [B]; stop token int [B]). Level
    max_depth never finds a child (nodes at the depth bound have none), so every row stops.
    """
    b = tree.tokens.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)

    def level(lvl, carry):
        cur, going, accepted, path, nxt = carry
        found, child, stop = choose(lvl, cur)
        nxt = jnp.where(going & ~found, stop, nxt)
        going = going & found
        cur = jnp.where(going, child, cur).astype(jnp.int32)
        path = path.at[:, lvl + 1].set(cur, mode="drop")
        return cur, going, accepted + going.astype(jnp.int32), path, nxt

    init = (zeros, jnp.ones((b,), bool), zeros, jnp.zeros((b, max_depth + 1), jnp.int32), zeros)
    _, _, accepted, path, nxt = jax.lax.fori_loop(0, max_depth + 1, level, init)
    return path, accepted, nxt


def node_rows(target_log_probs, cur: jax.Array) -> jax.Array:
    """[B, V]: the target's log-probs at node cur[b] of each row, from [B, N, V] or from a
    function of cur (a packed verify keeps them as [Σ nodes, V] and maps the index)."""
    if callable(target_log_probs):
        return target_log_probs(cur)
    return target_log_probs[jnp.arange(cur.shape[0]), cur]


def tree_greedy_accept(tree: DraftTree, best: jax.Array, max_depth: int):
    """best: the target's argmax at every node, int [B, N] -> (path, accepted, next token)."""
    def choose(_, cur):
        want = jnp.take_along_axis(best, cur[:, None], axis=1)[:, 0]
        match = children_mask(tree, cur) & (tree.tokens == want[:, None])
        return jnp.any(match, axis=1), jnp.argmax(match, axis=1), want

    return _walk(tree, max_depth, choose)


def sibling_accept_probs(p_children: jax.Array, renormalise: bool = True) -> jax.Array:
    """r_i = p(c_i) / (1 - S_{i-1}) for children probabilities [..., N] (0 for non-children),
    in node order. renormalise=False (deliberately lossy: r_i = p(c_i), the residual left
    unnormalised) exists so the tests can show that they detect a broken rule."""
    if not renormalise:
        return p_children
    rest = 1.0 - (jnp.cumsum(p_children, axis=-1) - p_children)  # 1 - S_{i-1}
    return jnp.where(p_children > 0, p_children / jnp.maximum(rest, p_children), 0.0)


def tree_sample_accept(tree: DraftTree, target_log_probs: jax.Array, keys: jax.Array, max_depth: int,
                       *, renormalise: bool = True):
    """The lossless rule of the module docstring.

    target_log_probs: [B, N, V] (after temperature / top-p) at every node, or a function of
    the current node (`node_rows`); keys: one PRNG key per row. Returns (path, accepted, next token) as `tree_greedy_accept`.
    """
    b, n = tree.tokens.shape

    def choose(lvl, cur):
        level_keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, lvl), 2))(keys)
        logp = node_rows(target_log_probs, cur)  # [B, V]
        v = logp.shape[1]
        rows = jnp.arange(b)
        p = jnp.exp(logp)
        kids = children_mask(tree, cur)
        p_kids = jnp.where(kids, jnp.take_along_axis(p, tree.tokens, axis=1), 0.0)
        u = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(level_keys[:, 0])
        hit = kids & (u < sibling_accept_probs(p_kids, renormalise))
        kid_tokens = jnp.zeros((b, v), bool).at[rows[:, None], tree.tokens].max(kids)
        residual = jnp.where(kid_tokens, -jnp.inf, logp)
        # Children covering all of p's mass leave no residual (probability-0 branch): use p.
        residual = jnp.where(jnp.any(jnp.isfinite(residual), axis=1, keepdims=True), residual, logp)
        stop = jax.vmap(jax.random.categorical)(level_keys[:, 1], residual).astype(jnp.int32)
        return jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), stop

    return _walk(tree, max_depth, choose)


def tree_coupled_accept(tree: DraftTree, target_log_probs: jax.Array, level_keys, max_depth: int):
    """Sampling coupled to AR: at level l the target's token is drawn from the current node's
    p with `level_keys(l)` [B] (the key AR sampling uses for that output position), exactly as
    `sampling.sample_next` draws it, and the walk moves to the child carrying it, if any.

    This is the rule of the module docstring with the draw done first ("sample X ~ p, follow
    the child that carries X"): every emitted token is distributed as p, the chance of moving
    to a child is the same Σ p(c_i), and the emitted tokens are those of AR sampling with the
    same keys, whatever the tree. Returns (path, accepted, next token).
    """
    def choose(lvl, cur):
        x = jax.vmap(jax.random.categorical)(level_keys(lvl), node_rows(target_log_probs, cur)).astype(jnp.int32)
        match = children_mask(tree, cur) & (tree.tokens == x[:, None])
        return jnp.any(match, axis=1), jnp.argmax(match, axis=1), x

    return _walk(tree, max_depth, choose)


def path_tokens(tree: DraftTree, path: jax.Array, accepted: jax.Array, nxt: jax.Array) -> jax.Array:
    """[B, D+1] emitted tokens: the accepted nodes' tokens (depth 1..a), then the stop token."""
    idx = jnp.arange(path.shape[1])[None]
    drafted = jnp.take_along_axis(tree.tokens, jnp.roll(path, -1, axis=1), axis=1)  # node at depth k+1
    return jnp.where(idx < accepted[:, None], drafted,
                     jnp.where(idx == accepted[:, None], nxt[:, None], 0)).astype(jnp.int32)

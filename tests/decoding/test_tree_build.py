"""Draft trees: best-first construction, ancestor masks, the greedy walk and path compaction.

Construction is checked against a literal best-first search (a heap over every
path of the full vocabulary, no top-k shortcut) on small vocabularies, with
unreachable tokens (probability 0) in some rows; the greedy walk against a
per-row Python walk; compaction against a per-slot copy.
"""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.decoding.tree_accept import path_tokens, tree_greedy_accept
from adaflash_jax.decoding.tree_build import ancestor_mask, build_tree, chain_tree
from adaflash_jax.models.kv_cache import path_entries, write_tokens

V, D, ROWS = 5, 3, 6


def random_log_probs(seed, rows=ROWS, depth=D, vocab=V, unreachable=True):
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal((rows, depth, vocab))
    if unreachable:  # rows 0 and 1: some tokens can never be drafted (a reduced draft vocabulary)
        logits[0, :, :2] = -np.inf
        logits[1, 1, 1:] = -np.inf
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


def best_first(logq: np.ndarray, budget: int) -> list[tuple[tuple[int, ...], float]]:
    """The first budget-1 (path, score) pairs a best-first search pops, root excluded."""
    depth, vocab = logq.shape
    heap = [(-float(logq[0, t]), (t,)) for t in range(vocab) if np.isfinite(logq[0, t])]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < budget - 1:
        neg, path = heapq.heappop(heap)
        out.append((path, -neg))
        if len(path) < depth:
            for t in range(vocab):
                if np.isfinite(logq[len(path), t]):
                    heapq.heappush(heap, (neg - float(logq[len(path), t]), path + (t,)))
    return out


def node_paths(tree, row):
    """Each valid drafted node's token path from the root, following parents."""
    tokens, parents, valid = (np.asarray(x[row]) for x in (tree.tokens, tree.parents, tree.valid))
    paths = []
    for i in range(1, len(tokens)):
        if not valid[i]:
            continue
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        paths.append(tuple(reversed(path)))
    return paths


build = jax.jit(build_tree, static_argnums=2)


@pytest.mark.parametrize("budget", [1, 2, 6, 17, 40, 160])
def test_matches_brute_force_best_first(budget):
    logq = random_log_probs(budget)
    roots = jnp.arange(ROWS, dtype=jnp.int32) + 20
    tree = build(jnp.asarray(logq), roots, budget)
    assert tree.tokens.shape == (ROWS, budget)
    for row in range(ROWS):
        want = best_first(logq[row], budget)
        assert node_paths(tree, row) == [p for p, _ in want]
        n = len(want)
        valid = np.asarray(tree.valid[row])
        assert valid[:n + 1].all() and not valid[n + 1:].any()  # valid nodes first, then padding
        np.testing.assert_allclose(np.asarray(tree.scores[row, 1:n + 1]), [s for _, s in want], rtol=1e-5)
        assert int(tree.tokens[row, 0]) == 20 + row and int(tree.parents[row, 0]) == -1
        parents, depths = np.asarray(tree.parents[row]), np.asarray(tree.depths[row])
        assert all(parents[i] < i and depths[i] == depths[parents[i]] + 1 for i in range(1, n + 1))
        assert np.all(np.diff(np.asarray(tree.scores[row, :n + 1])) <= 0)  # best-first order


def test_full_tree_when_budget_covers_every_path():
    logq = random_log_probs(7, rows=1, depth=2, vocab=3, unreachable=False)
    tree = build(jnp.asarray(logq), jnp.zeros((1,), jnp.int32), 1 + 3 + 9)
    assert sorted(node_paths(tree, 0)) == sorted([(a,) for a in range(3)] + [(a, b) for a in range(3)
                                                                            for b in range(3)])


def test_peaked_drafter_gives_the_greedy_chain():
    """The chain is the tree with one node per depth: with near-certain drafts it is what best-first builds."""
    rng = np.random.default_rng(0)
    argmax = rng.integers(0, V, (ROWS, D))
    logits = np.where(np.arange(V) == argmax[..., None], 30.0, rng.standard_normal((ROWS, D, V)))
    logq = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    tree = build(logq, jnp.zeros((ROWS,), jnp.int32), D + 1)
    chain = chain_tree(jnp.zeros((ROWS,), jnp.int32), jnp.asarray(argmax, jnp.int32))
    for field in ("tokens", "parents", "depths", "valid"):
        np.testing.assert_array_equal(getattr(tree, field), getattr(chain, field))


def test_ancestor_mask_matches_parent_walk():
    tree = build(jnp.asarray(random_log_probs(3)), jnp.zeros((ROWS,), jnp.int32), 17)
    mask = np.asarray(jax.jit(ancestor_mask, static_argnums=1)(tree, D))
    parents, valid = np.asarray(tree.parents), np.asarray(tree.valid)
    for row in range(ROWS):
        for i in range(17):
            want = np.zeros(17, bool)
            want[i] = True
            j = parents[row, i] if valid[row, i] else -1
            while j >= 0:
                want[j] = True
                j = parents[row, j]
            np.testing.assert_array_equal(mask[row, i], want, err_msg=f"row {row} node {i}")


def python_greedy_walk(tokens, parents, valid, best):
    cur, path = 0, [0]
    while True:
        kids = [j for j in range(len(tokens)) if valid[j] and parents[j] == cur and tokens[j] == best[cur]]
        if not kids:
            return path, int(best[cur])
        cur = kids[0]
        path.append(cur)


def test_greedy_walk_follows_the_target_argmax():
    rng = np.random.default_rng(4)
    tree = build(jnp.asarray(random_log_probs(4)), jnp.zeros((ROWS,), jnp.int32), 12)
    tokens, parents, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
    walk = jax.jit(tree_greedy_accept, static_argnums=2)
    for trial in range(6):
        # the target's argmax at each node: often one of its children's tokens, else anything
        best = rng.integers(0, V, (ROWS, 12))
        for row in range(ROWS):
            for i in range(12):
                kids = [j for j in range(12) if valid[row, j] and parents[row, j] == i]
                if kids and rng.random() < 0.8:
                    best[row, i] = tokens[row, rng.choice(kids)]
        path, accepted, nxt = walk(tree, jnp.asarray(best, jnp.int32), D)
        emitted = np.asarray(path_tokens(tree, path, accepted, nxt))
        for row in range(ROWS):
            want_path, want_next = python_greedy_walk(tokens[row], parents[row], valid[row], best[row])
            a = len(want_path) - 1
            assert int(accepted[row]) == a and int(nxt[row]) == want_next
            assert np.asarray(path[row, :a + 1]).tolist() == want_path
            assert emitted[row, :a + 1].tolist() == [int(tokens[row, j]) for j in want_path[1:]] + [want_next]


def test_path_entries_compact_a_path_and_the_rest_is_left():
    rng = np.random.default_rng(5)
    layers, b, hkv, s, dh, n, t = 2, 3, 2, 12, 4, 6, 4
    k = jnp.asarray(rng.standard_normal((layers, b, hkv, s, dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((layers, b, hkv, s, dh)), jnp.float32)
    node_k = jnp.asarray(rng.standard_normal((layers, b, hkv, n, dh)), jnp.float32)
    node_v = jnp.asarray(rng.standard_normal((layers, b, hkv, n, dh)), jnp.float32)
    offsets = jnp.asarray([0, 3, 10], jnp.int32)  # the last row's path runs past the cache: dropped
    path = jnp.asarray([[0, 2, 5, 1], [0, 1, 2, 3], [0, 3, 3, 3]], jnp.int32)
    nk, nv = jax.jit(lambda *a: write_tokens(*a[:2], *path_entries(*a[2:5]), a[5]))(k, v, node_k, node_v, path, offsets)
    for row in range(b):
        off = int(offsets[row])
        for i in range(s):
            rel = i - off
            want_k = node_k[:, row, :, int(path[row, rel])] if 0 <= rel < t else k[:, row, :, i]
            want_v = node_v[:, row, :, int(path[row, rel])] if 0 <= rel < t else v[:, row, :, i]
            np.testing.assert_array_equal(nk[:, row, :, i], want_k)
            np.testing.assert_array_equal(nv[:, row, :, i], want_v)


def test_a_reduced_vocabulary_builds_the_tree_of_its_spread_distribution():
    """Scoring only the K draft columns (mapped through d2t) gives the full-vocabulary tree,
    ties included: q is zero outside the draft vocabulary."""
    rng = np.random.default_rng(9)
    v, kd = 40, 12
    d2t = jnp.asarray(np.sort(rng.choice(v, kd, replace=False)), jnp.int32)
    logits = jnp.asarray(np.round(rng.standard_normal((3, 5, kd)), 1), jnp.float32)  # rounded: ties
    logq = jax.nn.log_softmax(logits, axis=-1)
    full = jnp.full((3, 5, v), -jnp.inf).at[..., d2t].set(logq)
    roots = jnp.asarray([3, 7, 1], jnp.int32)
    for n in (2, 9, 20):
        got, want = build_tree(logq, roots, n, d2t), build_tree(full, roots, n)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""The target's tree forward: each node sees exactly its ancestors, and compaction commits its path.

A node's hidden state must equal what the target computes for the prompt
followed by the node's path, run on its own; after moving the accepted path's
K/V to contiguous slots, the cache must hold what decoding that path token by
token writes. Checked on the tiny test target, two rows of different prompt
lengths, a random best-first tree.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding.tree_build import ancestor_mask, build_tree, chain_tree
from adaflash_jax.decoding.autoregressive import new_cache
from adaflash_jax.models.kv_cache import path_entries

PROMPTS = [[5, 17, 3, 9, 1], [2, 2, 8, 19, 27, 6, 11, 0]]
NODES, DEPTH, CACHE = 14, 4, 32
TOL = dict(atol=2e-5, rtol=2e-5)


def prefilled(module, prompts):
    """A cache holding the right-padded prompts, committed to their lengths."""
    t = max(map(len, prompts))
    tokens = jnp.asarray([p + [0] * (t - len(p)) for p in prompts], jnp.int32)
    cache = new_cache(module, len(prompts), CACHE)
    out = module(tokens, cache=cache)
    return out.cache.with_lengths(jnp.asarray([len(p) for p in prompts], jnp.int32))


def stacked(buffers) -> np.ndarray:
    """A cache's K or V as one [L, B, Hkv, S, Dh] array, in either layer layout."""
    return np.stack([np.asarray(b) for b in buffers])


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"))
def tree_run(graphdef, state, tree, anc, prompts_tokens, lengths, impl="xla"):
    module = nnx.merge(graphdef, state)
    cache = new_cache(module, lengths.shape[0], CACHE)
    cache = module(prompts_tokens, cache=cache).cache.with_lengths(lengths)
    return module.tree_forward(tree.tokens, tree.depths, anc, cache, attn_impl=impl), cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def plain_run(graphdef, state, tokens):
    """hidden [1, T, D] and the K/V the target writes for tokens [1, T] from an empty cache."""
    module = nnx.merge(graphdef, state)
    cache = new_cache(module, 1, CACHE)
    out = module(tokens, cache=cache)
    return out.hidden, out.cache


def path_of(tree, row, node):
    tokens, parents = np.asarray(tree.tokens[row]), np.asarray(tree.parents[row])
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1], [int(tokens[j]) for j in path[::-1]]


@pytest.fixture(scope="module")
def tree_case(target):
    rng = np.random.default_rng(0)
    logq = jax.nn.log_softmax(jnp.asarray(5.0 * rng.standard_normal((2, DEPTH, H.TINY.vocab_size)),
                                          jnp.float32), axis=-1)
    roots = jnp.asarray([13, 4], jnp.int32)
    tree = build_tree(logq, roots, NODES)
    anc = ancestor_mask(tree, DEPTH)
    t = max(map(len, PROMPTS))
    tokens = jnp.asarray([p + [0] * (t - len(p)) for p in PROMPTS], jnp.int32)
    lengths = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    out, cache = tree_run(target.graphdef, target.state, tree, anc, tokens, lengths)
    return tree, anc, tokens, lengths, out, cache


def test_every_node_sees_exactly_its_ancestors(target, tree_case):
    tree, _, _, _, out, _ = tree_case
    assert int(np.asarray(tree.depths).max()) >= 3  # a real tree: several levels and branches
    for row, prompt in enumerate(PROMPTS):
        for node in range(NODES):
            _, toks = path_of(tree, row, node)
            hidden, _ = plain_run(target.graphdef, target.state, jnp.asarray([prompt + toks], jnp.int32))
            np.testing.assert_allclose(np.asarray(out.hidden[row, node]), np.asarray(hidden[0, -1]),
                                       err_msg=f"row {row} node {node}", **TOL)


def test_compacted_path_cache_equals_sequential_decode(target, tree_case):
    tree, _, _, lengths, out, cache = tree_case
    depths = np.asarray(tree.depths)
    paths = []
    for row in range(2):
        deepest = int(np.argmax(depths[row]))
        nodes, _ = path_of(tree, row, deepest)
        paths.append(nodes + [nodes[-1]] * (DEPTH + 1 - len(nodes)))
    written = cache.write(*path_entries(out.node_k, out.node_v, jnp.asarray(paths, jnp.int32)), lengths)
    k, v = stacked(written.k), stacked(written.v)
    for row, prompt in enumerate(PROMPTS):
        nodes, toks = path_of(tree, row, paths[row][-1])
        _, cache = plain_run(target.graphdef, target.state, jnp.asarray([prompt + toks], jnp.int32))
        end = len(prompt) + len(toks)
        np.testing.assert_allclose(k[:, row, :, :end], stacked(cache.k)[:, 0, :, :end], **TOL)
        np.testing.assert_allclose(v[:, row, :, :end], stacked(cache.v)[:, 0, :, :end], **TOL)


def test_chain_tree_forward_equals_causal_forward(target):
    """A chain (node i under node i-1) is an ordinary causal verify pass."""
    rng = np.random.default_rng(1)
    t = max(map(len, PROMPTS))
    tokens = jnp.asarray([p + [0] * (t - len(p)) for p in PROMPTS], jnp.int32)
    lengths = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    block = jnp.asarray(rng.integers(0, H.TINY.vocab_size, (2, 6)), jnp.int32)
    chain = chain_tree(block[:, 0], block[:, 1:])
    out, cache = tree_run(target.graphdef, target.state, chain, ancestor_mask(chain, 5), tokens, lengths)

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def causal(graphdef, state, cache, block):
        return nnx.merge(graphdef, state)(block, cache=cache)

    want = causal(target.graphdef, target.state, cache, block)
    np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(want.hidden), **TOL)
    chain = jnp.broadcast_to(jnp.arange(6), (2, 6))
    k = cache.write(*path_entries(out.node_k, out.node_v, chain), lengths).k
    np.testing.assert_allclose(stacked(k), stacked(want.cache.k), **TOL)


def test_pallas_tree_forward_matches_xla(target, tree_case):
    """attn_impl="pallas" routes the tree attention to `pallas_kernels.tree_attention` (interpreted here)."""
    tree, anc, tokens, lengths, out, _ = tree_case
    got, _ = tree_run(target.graphdef, target.state, tree, anc, tokens, lengths, impl="pallas")
    np.testing.assert_allclose(np.asarray(got.hidden), np.asarray(out.hidden), **TOL)
    np.testing.assert_allclose(np.asarray(got.node_k), np.asarray(out.node_k), **TOL)
    np.testing.assert_allclose(np.asarray(got.node_v), np.asarray(out.node_v), **TOL)

"""A non-finite token reaches exactly the queries that attend to it, in the packed verifications.

Attention gives a masked key weight 0, and 0 x NaN = NaN: a NaN value at a masked slot would
poison queries that must not see it. In a packed verify (chain: `TargetLM.packed_forward`,
the "head" / "auto" chain policies; tree: `TargetLM.packed_tree_forward`, the adaptive
decoder) those are the row's own earlier tokens or sibling nodes, the other rows' tokens
beside it in the buffer, and cache slots past a row's length, where a rejected draft or an
earlier request left its K/V. The projections store non-finite values as 0
(`decoder_layers.project_kv`); the checks below are exact, so finite numbers are not changed
either. Both the XLA forms and the Pallas kernels (interpreted on a CPU) are checked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
from adaflash_jax.decoding.autoregressive import new_cache, prefill
from adaflash_jax.decoding.sampling import NONFINITE_TOKEN
from adaflash_jax.models.packed_layout import pack_layout
from nonfinite_helpers import poisoned
from spec_helpers import TINY

POISON = 5
CACHE_LEN, SLOTS, WIDTH = 16, 12, 4
PROMPTS = [[9, 1, 22, 30], [2, 8, 19, 27, 6, 11], [7, 28, 13]]
CLEAN = [[3, 4, 12, 16], [21, 10, 7, 9], [24, 29, 1, 2]]
LENGTHS, SHORT = [3, 4, 2], [3, 2, 2]  # SHORT: row 1 stops before the poisoned slot
POISONED = [row[:] for row in CLEAN]
POISONED[1][2] = POISON
# Tree: node 1 and node 2 are the root's children, node 3 is node 1's; every row the same.
DEPTHS = np.array([0, 1, 1, 2], np.int32)
ANCESTORS = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
# The verified positions that see row 1's slot 2: later chain tokens, the node and its subtree.
SEES = {"chain": [[0] * 4, [0, 0, 1, 1], [0] * 4], "tree": [[0] * 4, [0, 0, 1, 0], [0] * 4]}
CASES = [("chain", "xla", "stacked"), ("chain", "xla", "per_layer"), ("chain", "pallas", "stacked"),
         ("tree", "xla", "stacked"), ("tree", "pallas", "stacked")]


@functools.lru_cache(maxsize=None)
def bad_target(layout: str):
    return poisoned(af.random_target(TINY, seed=0, layer_layout=layout), POISON)


@functools.partial(jax.jit, static_argnums=0)
def prefilled(graphdef, state):
    model = nnx.merge(graphdef, state)
    tokens = jnp.asarray([p + [0] * (8 - len(p)) for p in PROMPTS], jnp.int32)
    lengths = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    return prefill(model, tokens, lengths, new_cache(model, len(PROMPTS), CACHE_LEN))[2]


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def verify(graphdef, state, block, lengths, cache, kind: str, impl: str):
    """The packed verify of `kind` -> (hidden [B, W, D], greedy ids [B, W], the cache it leaves)."""
    model = nnx.merge(graphdef, state)
    layout = pack_layout(lengths, SLOTS, WIDTH)
    tokens = layout.pack(block)
    if kind == "chain":
        out = model.packed_forward(tokens, layout, cache, attn_impl=impl)
        cache = out.cache
    else:
        b = block.shape[0]
        depths = layout.pack(jnp.broadcast_to(jnp.asarray(DEPTHS), (b, WIDTH)))
        ancestors = jnp.broadcast_to(jnp.asarray(ANCESTORS), (b, WIDTH, WIDTH))
        out = model.packed_tree_forward(tokens, depths, layout, ancestors, cache, attn_impl=impl)
    return layout.unpack(out.hidden), layout.unpack(model.greedy_tokens(out.hidden)), cache


def run(target, block, lengths, cache, kind, impl):
    out = verify(target.graphdef, target.state, jnp.asarray(block, jnp.int32), jnp.asarray(lengths, jnp.int32),
                 cache, kind, impl)
    return tuple(np.asarray(x) if isinstance(x, jax.Array) else x for x in out)


def verified(lengths) -> np.ndarray:
    return np.arange(WIDTH)[None] < np.asarray(lengths)[:, None]


@pytest.mark.parametrize("kind,impl,layout", CASES)
def test_a_poisoned_token_reaches_only_the_queries_that_see_it(kind, impl, layout):
    target = bad_target(layout)
    cache = prefilled(target.graphdef, target.state)
    hidden, ids, _ = run(target, POISONED, LENGTHS, cache, kind, impl)
    clean_hidden, clean_ids, _ = run(target, CLEAN, LENGTHS, cache, kind, impl)
    sees = np.asarray(SEES[kind], bool)
    others = verified(LENGTHS) & ~sees
    assert (ids[sees] == NONFINITE_TOKEN).all()  # the poisoned row is still caught where it should be
    np.testing.assert_array_equal(hidden[others], clean_hidden[others])
    assert (clean_ids[verified(LENGTHS)] >= 0).all()


@pytest.mark.parametrize("kind,impl,layout", CASES)
def test_poisoned_entries_past_a_row_length_change_nothing(kind, impl, layout):
    """A chain verify writes the poisoned draft's K/V past row 1's length (lengths are not
    advanced: the draft was rejected); reading that cache equals reading the prefilled one."""
    target = bad_target(layout)
    fresh = prefilled(target.graphdef, target.state)
    stale = run(target, POISONED, LENGTHS, fresh, "chain", impl)[2]
    hidden, ids, _ = run(target, CLEAN, SHORT, stale, kind, impl)
    want, _, _ = run(target, CLEAN, SHORT, fresh, kind, impl)
    keep = verified(SHORT)
    np.testing.assert_array_equal(hidden[keep], want[keep])
    assert (ids[keep] >= 0).all()
    for values in jax.tree.leaves(stale.v):  # non-finite values never enter the cache
        assert np.isfinite(np.asarray(values)).all()

"""The lazy greedy head (`acceptance.lazy_greedy_ids`): the fixed-policy greedy verify scores
block indices chunk by chunk and stops once every row has rejected a draft; acceptance must be
exactly what the full head gives."""

import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.decoding import acceptance


def _argmax_fn(weight):
    return lambda h: jnp.argmax(h @ weight, axis=-1).astype(jnp.int32)


@pytest.mark.parametrize("block", [2, 4, 16])
def test_lazy_head_accepts_exactly_as_the_full_head(block):
    rng = np.random.default_rng(block)
    b, d, v = 6, 8, 11
    weight = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    argmax = _argmax_fn(weight)
    for trial in range(20):
        hidden = jnp.asarray(rng.normal(size=(b, block, d)), jnp.float32)
        best = np.asarray(argmax(hidden))
        # drafts copy the target's choices up to a per-row cut, then differ (or run to the end)
        cut = rng.integers(0, block, size=b)
        drafts = best[:, :-1].copy()
        for row in range(b):
            drafts[row, cut[row]:] = (drafts[row, cut[row]:] + 1) % v
        verify_len = jnp.asarray(rng.integers(1, block + 1, size=b), jnp.int32)
        lazy = acceptance.lazy_greedy_ids(argmax, hidden, jnp.asarray(drafts), verify_len)
        want = acceptance.greedy_accept_ids(jnp.asarray(drafts), jnp.asarray(best), verify_len)
        got = acceptance.greedy_accept_ids(jnp.asarray(drafts), lazy, verify_len)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        # every index up to and including the emitted one was scored by the head
        lazy = np.asarray(lazy)
        for row in range(b):
            a = int(want[0][row])
            np.testing.assert_array_equal(lazy[row, :a + 1], best[row, :a + 1])


def test_lazy_head_scores_only_the_first_index_when_every_row_rejects():
    def argmax(h):
        return jnp.zeros(h.shape[:2], jnp.int32)

    hidden = jnp.zeros((3, 16, 4))
    drafts = jnp.ones((3, 15), jnp.int32)  # the target says 0 everywhere: all rejected at once
    best = acceptance.lazy_greedy_ids(argmax, hidden, drafts, jnp.full((3,), 16, jnp.int32))
    assert np.all(np.asarray(best)[:, 1:] == -1)  # the later chunks never ran
    np.testing.assert_array_equal(np.asarray(best)[:, 0], 0)


def test_lazy_chunks_cover_the_block():
    for block in range(1, 33):
        chunks = acceptance.lazy_chunks(block)
        assert sum(chunks) == block and chunks[0] == 1

"""Paged K/V against the contiguous cache: the same writes read back the same keys, and
attention over a page view of mixed-length slots equals attention over the contiguous
cache, at every view width that covers the live lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.decoding.page_allocator import PageAllocator
from adaflash_jax.models import layers, paged_kv
from adaflash_jax.models.kv_cache import write_layer_packed, write_layer_tokens

B, HKV, H, DH, PAGE, MAX_PAGES, POOL = 3, 2, 4, 8, 4, 5, 16
LENGTHS = [13, 3, 20]  # mixed: one slot fills its whole table


def setup(rng):
    """The allocator with pages for LENGTHS, in a scrambled order (slots' pages interleave),
    and both caches holding the same prefill of every slot."""
    alloc = PageAllocator(POOL, PAGE, B, MAX_PAGES)
    alloc.grow(1, 1)  # slot 1 takes a page first, so slot 0's pages are not the lowest ids
    for slot, n in enumerate(LENGTHS):
        alloc.grow(slot, n)
    table = jnp.asarray(alloc.table)
    pool = jnp.zeros((HKV, POOL, PAGE, DH), jnp.float32)
    dense = jnp.zeros((B, HKV, MAX_PAGES * PAGE, DH), jnp.float32)
    new = jnp.asarray(rng.normal(size=(B, HKV, max(LENGTHS), DH)), jnp.float32)
    zeros = jnp.zeros((B,), jnp.int32)
    pool = paged_kv.write_tokens(pool, table, new, zeros)
    dense, _ = write_layer_tokens(dense, dense, new, new, zeros)
    return alloc, table, pool, dense


def test_writes_read_back_as_the_contiguous_cache_within_each_slots_pages():
    alloc, table, pool, dense = setup(np.random.default_rng(0))
    view = paged_kv.gather_view(pool, table, MAX_PAGES)
    for slot in range(B):
        held = alloc.capacity(slot)
        np.testing.assert_array_equal(view[slot, :, :held], dense[slot, :, :held])
        assert not np.any(view[slot, :, held:])  # no page there: zeros, never another slot's keys


def test_packed_writes_match_and_padding_is_dropped():
    rng = np.random.default_rng(1)
    alloc, table, pool, dense = setup(rng)
    seq_ids = jnp.asarray([0, 0, 1, 2, 1], jnp.int32)
    positions = jnp.asarray([13, 14, 3, 19, MAX_PAGES * PAGE + 2], jnp.int32)  # the last: padding
    new = jnp.asarray(rng.normal(size=(5, HKV, DH)), jnp.float32)
    pool = paged_kv.write_packed(pool, table, new, seq_ids, positions)
    dense, _ = write_layer_packed(dense, dense, new, new, seq_ids, positions)
    view = paged_kv.gather_view(pool, table, MAX_PAGES)
    for slot in range(B):
        held = alloc.capacity(slot)
        np.testing.assert_array_equal(view[slot, :, :held], dense[slot, :, :held])


@pytest.mark.parametrize("num_pages", [MAX_PAGES - 1, MAX_PAGES])
def test_attention_over_a_page_view_equals_the_contiguous_cache(num_pages):
    rng = np.random.default_rng(2)
    _, table, pool, dense = setup(rng)
    lengths = jnp.asarray([13, 3, 16], jnp.int32)  # committed: within num_pages · PAGE
    q = jnp.asarray(rng.normal(size=(B, H, 2, DH)), jnp.float32)

    def attend(keys):
        slot = jnp.arange(keys.shape[2])[None, None, :]
        mask = jnp.broadcast_to(slot < lengths[:, None, None], (B, 2, keys.shape[2]))
        return layers.attention(q, keys, keys, mask)

    view = paged_kv.gather_view(pool, table, num_pages)
    np.testing.assert_allclose(attend(view), attend(dense), rtol=1e-6, atol=1e-6)


def test_view_width_follows_the_live_lengths():
    assert paged_kv.pages_to_view(1, PAGE, (1, 2, 4, 8)) == 1
    assert paged_kv.pages_to_view(9, PAGE, (1, 2, 4, 8)) == 4
    assert paged_kv.pages_to_view(100, PAGE, (1, 2, 4, 8)) == 8
    jitted = jax.jit(paged_kv.gather_view, static_argnums=2)
    _, table, pool, _ = setup(np.random.default_rng(3))
    assert jitted(pool, table, 2).shape == (B, HKV, 2 * PAGE, DH)

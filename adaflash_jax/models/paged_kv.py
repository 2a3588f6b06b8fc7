"""One layer's paged K/V: reads and writes through a page table (the XLA path).

A layer's keys (and values) live in one pool `[Hkv, P, page, Dh]` of P pages of
`page` positions (head-major, the layout of JAX's TPU paged-attention kernel).
Slot b's position p is at page `table[b, p // page]`, offset `p % page`; the
host hands out pages (`decoding.page_allocator`), and unused table entries hold
`NO_PAGE = P`, one past the pool.

- `gather_view(pool, table, n)`: a contiguous `[B, Hkv, n·page, Dh]` view of every
  slot's first n pages, for the attention the contiguous cache uses (its mask by
  length hides everything past a slot's committed length). n is chosen by the
  caller from the live lengths (bucketed, so a few shapes compile), so a step's
  attention costs what the longest live row needs, not what the longest request
  the server could admit would. A `NO_PAGE` entry reads as zeros.
- `write_tokens` / `write_packed`: new K/V scattered to their pages; a position
  without a page (past the slot's table, or at `NO_PAGE`) is dropped, never wrapped,
  like the contiguous cache's writes past max_len.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def page_index(table: jax.Array, slots: jax.Array, positions: jax.Array, page: int, no_page: int):
    """(page id, offset) of positions of slots, same shapes: NO_PAGE where a position is past
    the table (or negative)."""
    col = positions // page
    inside = (positions >= 0) & (col < table.shape[1])
    pages = jnp.where(inside, table[slots, jnp.clip(col, 0, table.shape[1] - 1)], no_page)
    return pages, positions % page


def gather_view(pool: jax.Array, table: jax.Array, num_pages: int) -> jax.Array:
    """[B, Hkv, num_pages·page, Dh]: every slot's first num_pages pages in position order
    (zeros where a slot has no page)."""
    hkv, _, page, dh = pool.shape
    pages = jnp.take(pool, table[:, :num_pages], axis=1, mode="fill", fill_value=0)  # [Hkv, B, n, page, Dh]
    b = table.shape[0]
    return jnp.moveaxis(pages, 0, 1).reshape(b, hkv, num_pages * page, dh)


def write_tokens(pool: jax.Array, table: jax.Array, new: jax.Array, offsets: jax.Array) -> jax.Array:
    """new [B, Hkv, T, Dh] (T tokens of each slot) written at positions offsets[b] + t."""
    b, _, t, _ = new.shape
    positions = offsets[:, None] + jnp.arange(t, dtype=offsets.dtype)[None]
    pages, offs = page_index(table, jnp.arange(b)[:, None], positions, pool.shape[2], pool.shape[1])
    return pool.at[:, pages, offs].set(jnp.moveaxis(new, 1, 0).astype(pool.dtype), mode="drop")


def write_packed(pool: jax.Array, table: jax.Array, new: jax.Array, seq_ids: jax.Array,
                 positions: jax.Array) -> jax.Array:
    """Packed new [N, Hkv, Dh] written at (seq_ids[j], positions[j]); padding entries, whose
    position is past their slot's table, are dropped."""
    pages, offs = page_index(table, seq_ids, positions, pool.shape[2], pool.shape[1])
    return pool.at[:, pages, offs].set(jnp.swapaxes(new, 0, 1).astype(pool.dtype), mode="drop")


def pages_to_view(live_len: int, page: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket of pages (static, ascending) that covers live_len positions: the
    view width for a step whose longest row, new tokens included, reaches live_len (a host
    int). The largest bucket when none does (the table's width bounds every slot anyway)."""
    need = -(-int(live_len) // page)
    return next((n for n in buckets if n >= need), buckets[-1])

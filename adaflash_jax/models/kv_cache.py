"""Head-major KV cache with per-sequence lengths, stacked or per layer.

Stacked: `[layers, batch, kv_heads, max_len, head_dim]`, for a layer scan. A
forward reads each layer's slice as a scan input, attends to it plus the new
tokens' keys, and writes the new keys/values of all layers after the scan with
one scatter at each sequence's current length. (Returning the whole cache as
the scan's per-layer output builds a fresh cache-sized buffer per forward.)

Per layer: a tuple of `[batch, kv_heads, max_len, head_dim]` buffers, for the
unrolled inference layout (`models.decoder_layers`). Each layer writes its new
K/V first and then reads the written buffer, so XLA updates every buffer in
place; reading first and writing after the last layer made it copy all of them.

Writing does not commit: committing means setting `lengths`, and rolling back a
rejected speculative suffix means setting them lower. Stale entries past a
length are masked by position, so they never need clearing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array | tuple[jax.Array, ...]  # [L, B, Hkv, S, Dh], or per layer: L x [B, Hkv, S, Dh]
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array  # int32 [B]: committed tokens per sequence

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int,
               head_dim: int, dtype=jnp.float32, *, per_layer: bool = False) -> "KVCache":
        """An empty cache, stacked (one array per K and V, for a layer scan) or per layer (one
        buffer per layer, for the unrolled inference layout: `models.decoder_layers`)."""
        lengths = jnp.zeros((batch,), jnp.int32)
        if per_layer:
            shape = (batch, num_kv_heads, max_len, head_dim)
            return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                       v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)), lengths=lengths)
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=lengths)

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2] if self.per_layer else self.k.shape[3]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        """Commit (or roll back to) the given per-sequence lengths."""
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def layer_k(self, i: int) -> jax.Array:
        """Layer i's keys [B, Hkv, S, Dh]."""
        return self.k[i]

    def _map(self, fn, *others: "KVCache") -> "KVCache":
        """fn(buffer, batch_axis, *other caches' buffers) for every K and V buffer: each layer's
        (batch axis 0), or the stacked array (batch axis 1)."""
        def one(x, *ys):
            if self.per_layer:
                return tuple(fn(a, 0, *bs) for a, *bs in zip(x, *ys))
            return fn(x, 1, *ys)
        return self.replace(k=one(self.k, *(o.k for o in others)), v=one(self.v, *(o.v for o in others)))

    def rows(self, slots: jax.Array) -> "KVCache":
        """The cache of rows `slots` (lengths included)."""
        taken = self._map(lambda x, axis: x[(slice(None),) * axis + (slots,)])
        return taken.replace(lengths=self.lengths[slots])

    def put_rows(self, slots: jax.Array, rows: "KVCache") -> "KVCache":
        """This cache with rows `slots` replaced by `rows`' K/V (lengths left as they are)."""
        return self._map(lambda x, axis, r: x.at[(slice(None),) * axis + (slots,)].set(r), rows)

    def zero_rows(self, which: jax.Array) -> "KVCache":
        """Rows where `which` (bool [B]) is set zeroed, as in a fresh cache."""
        def zero(x, axis):
            mask = which.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))
            return jnp.where(mask, jnp.zeros_like(x), x)
        return self._map(zero)

    def slot_axes(self) -> "KVCache":
        """A tree like this cache whose leaves give each leaf's batch (slot) axis."""
        axis = 0 if self.per_layer else 1
        return self.replace(k=jax.tree.map(lambda _: axis, self.k), v=jax.tree.map(lambda _: axis, self.v),
                            lengths=0)

    def write(self, k_new: jax.Array, v_new: jax.Array, offsets: jax.Array) -> "KVCache":
        """Every layer's k/v_new [L, B, Hkv, T, Dh] written at per-sequence offsets [B]
        (`write_tokens`); lengths are left for the caller to commit."""
        if not self.per_layer:
            return self.replace(**dict(zip("kv", write_tokens(self.k, self.v, k_new, v_new, offsets))))
        pairs = [write_layer_tokens(ck, cv, kn, vn, offsets)
                 for ck, cv, kn, vn in zip(self.k, self.v, k_new, v_new)]
        return self.replace(k=tuple(p[0] for p in pairs), v=tuple(p[1] for p in pairs))


def write_tokens(cache_k: jax.Array, cache_v: jax.Array, k_new: jax.Array, v_new: jax.Array,
                 offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes every layer's k/v_new [L, B, Hkv, T, Dh] into the cache [L, B, Hkv, S, Dh] at
    per-sequence offsets [B].

    One scatter for all layers; inside a decode loop the cache is loop state, so XLA
    updates it in place. Positions past max_len are dropped, never wrapped or clamped.
    """
    b, t = k_new.shape[1], k_new.shape[3]
    rows = jnp.arange(b)[:, None]
    pos = offsets[:, None] + jnp.arange(t)[None]
    k_vals = jnp.transpose(k_new, (1, 3, 0, 2, 4)).astype(cache_k.dtype)  # [B, T, L, Hkv, Dh]
    v_vals = jnp.transpose(v_new, (1, 3, 0, 2, 4)).astype(cache_v.dtype)
    cache_k = cache_k.at[:, rows, :, pos].set(k_vals, mode="drop")
    cache_v = cache_v.at[:, rows, :, pos].set(v_vals, mode="drop")
    return cache_k, cache_v


def write_packed(cache_k: jax.Array, cache_v: jax.Array, k_new: jax.Array, v_new: jax.Array,
                 seq_ids: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes every layer's packed k/v_new [L, N, Hkv, Dh] at (seq_ids[j], positions[j]).

    One scatter for all layers, as in `write_tokens`. Positions >= max_len are
    dropped, which is how the padding slots of a packed layout never write.
    """
    k_vals = jnp.swapaxes(k_new, 0, 1).astype(cache_k.dtype)  # [N, L, Hkv, Dh]
    v_vals = jnp.swapaxes(v_new, 0, 1).astype(cache_v.dtype)
    cache_k = cache_k.at[:, seq_ids, :, positions].set(k_vals, mode="drop")
    cache_v = cache_v.at[:, seq_ids, :, positions].set(v_vals, mode="drop")
    return cache_k, cache_v


def write_layer_tokens(cache_k: jax.Array, cache_v: jax.Array, k_new: jax.Array, v_new: jax.Array,
                       offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer's `write_tokens`: k/v_new [B, Hkv, T, Dh] into [B, Hkv, S, Dh] at offsets [B]."""
    b, t = k_new.shape[0], k_new.shape[2]
    rows = jnp.arange(b)[:, None]
    pos = offsets[:, None] + jnp.arange(t)[None]
    cache_k = cache_k.at[rows, :, pos].set(jnp.swapaxes(k_new, 1, 2).astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[rows, :, pos].set(jnp.swapaxes(v_new, 1, 2).astype(cache_v.dtype), mode="drop")
    return cache_k, cache_v


def write_layer_packed(cache_k: jax.Array, cache_v: jax.Array, k_new: jax.Array, v_new: jax.Array,
                       seq_ids: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer's `write_packed`: packed k/v_new [N, Hkv, Dh] at (seq_ids[j], positions[j])."""
    cache_k = cache_k.at[seq_ids, :, positions].set(k_new.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[seq_ids, :, positions].set(v_new.astype(cache_v.dtype), mode="drop")
    return cache_k, cache_v


def path_entries(node_k: jax.Array, node_v: jax.Array, path: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every layer's K/V of the tree nodes `path[b, t]` [L, B, Hkv, T, Dh], from the per-node
    entries [L, B, Hkv, N, Dh] that `TargetLM.tree_forward` returns: an accepted path in
    order, for `write_tokens` to put at contiguous positions (the compaction). The cache is
    then only written, never read, so inside a decode loop it is updated in place."""
    idx = path[None, :, None, :, None]
    return jnp.take_along_axis(node_k, idx, axis=3), jnp.take_along_axis(node_v, idx, axis=3)

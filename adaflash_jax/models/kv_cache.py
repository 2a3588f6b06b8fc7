"""Head-major KV cache with per-sequence lengths.

Layout `[layers, batch, kv_heads, max_len, head_dim]`. A forward pass writes
its new keys/values at each sequence's current length (one scatter per layer
inside the layer scan, the layer's slice flowing through the scan as xs/ys;
measured faster on CPU than updating the whole stacked cache in the scan
carry, which XLA copied per layer) but does not commit them: committing means
setting `lengths`, and rolling back a rejected speculative suffix means
setting them lower. Stale entries past a length are masked by position, so
they never need clearing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, Hkv, S, Dh]
    v: jax.Array
    lengths: jax.Array  # int32 [B]: committed tokens per sequence

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int,
               head_dim: int, dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        """Commit (or roll back to) the given per-sequence lengths."""
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def write_layer(layer_k: jax.Array, layer_v: jax.Array, k_new: jax.Array, v_new: jax.Array,
                offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes k/v_new [B, Hkv, T, Dh] into one layer's cache [B, Hkv, S, Dh] at offsets [B].

    One scatter; positions past max_len are dropped, never wrapped or clamped.
    """
    b, _, t, _ = k_new.shape
    rows = jnp.arange(b)[:, None]
    pos = offsets[:, None] + jnp.arange(t)[None]
    k_vals = jnp.swapaxes(k_new, 1, 2).astype(layer_k.dtype)  # [B, T, Hkv, Dh]
    v_vals = jnp.swapaxes(v_new, 1, 2).astype(layer_v.dtype)
    layer_k = layer_k.at[rows, :, pos].set(k_vals, mode="drop")
    layer_v = layer_v.at[rows, :, pos].set(v_vals, mode="drop")
    return layer_k, layer_v

"""Draft-tree verification attention: one fused kernel per (row, kv head).

Each of a row's N tree nodes attends to the row's KV cache and to its own
ancestors in the tree (itself included), given as a boolean ancestor mask.
Layout, grids and costs: pallas_kernels/README.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels._verify_attention_kernels import gpu_tree_attention, tpu_tree_attention
from pallas_kernels.common import choose_kernel
from pallas_kernels.tiling import divisor_tile, is_triton_tile, next_pow2, round_up, sublane_align
from pallas_kernels.verify_attention import BlockSizes  # the same cache tiling as packed verification

__all__ = ["BlockSizes", "tree_attention", "tree_attention_reference"]


def _check_shapes(q, k_new, v_new, cache_k, cache_v, cache_lengths, ancestors):
    """Raises ValueError on inconsistent shapes; returns (B, H, N, Dh, Hkv, S)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, H, N, Dh]; got shape {q.shape}")
    b, h, n, dh = q.shape
    if k_new.ndim != 4 or k_new.shape[0] != b or k_new.shape[2:] != (n, dh):
        raise ValueError(f"k_new must be [B={b}, Hkv, N={n}, Dh={dh}]; got shape {k_new.shape}")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new must match k_new's shape {k_new.shape}; got {v_new.shape}")
    hkv = k_new.shape[1]
    if cache_k.ndim != 4 or cache_k.shape[:2] != (b, hkv) or cache_k.shape[3] != dh:
        raise ValueError(f"cache_k must be [B={b}, Hkv={hkv}, S, Dh={dh}]; got shape {cache_k.shape}")
    if cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_v must match cache_k's shape {cache_k.shape}; got {cache_v.shape}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    if tuple(cache_lengths.shape) != (b,) or not jnp.issubdtype(cache_lengths.dtype, jnp.integer):
        raise ValueError(f"cache_lengths must be an int array of shape [B={b}]; got "
                         f"{cache_lengths.dtype}{tuple(cache_lengths.shape)}")
    if tuple(ancestors.shape) != (b, n, n):
        raise ValueError(f"ancestors must have shape [B={b}, N={n}, N={n}]; got {tuple(ancestors.shape)}")
    return b, h, n, dh, hkv, cache_k.shape[2]


def tree_attention_reference(q, k_new, v_new, cache_k, cache_v, cache_lengths, ancestors):
    """The definition, in plain jnp with an explicit mask, in float32.

    Node i of row b sees the cache slots < cache_lengths[b] and the nodes j with
    ancestors[b, i, j]. A node that sees nothing gets zeros. Returns [B, H, N, Dh]
    in q's dtype.
    """
    b, h, n, dh, hkv, s = _check_shapes(q, k_new, v_new, cache_k, cache_v, cache_lengths, ancestors)
    hi, f32 = jax.lax.Precision.HIGHEST, jnp.float32
    qg = q.astype(f32).reshape(b, hkv, h // hkv, n, dh)
    keys = jnp.concatenate([cache_k.astype(f32), k_new.astype(f32)], axis=2)
    values = jnp.concatenate([cache_v.astype(f32), v_new.astype(f32)], axis=2)
    scores = jnp.einsum("bkgnd,bksd->bkgns", qg, keys, precision=hi) * (1.0 / math.sqrt(dh))
    cached = jnp.arange(s)[None, None] < cache_lengths.astype(jnp.int32)[:, None, None]
    mask = jnp.concatenate([jnp.broadcast_to(cached, (b, n, s)), ancestors.astype(bool)], axis=-1)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("bkgns,bksd->bkgnd", weights / jnp.where(denom > 0, denom, 1.0), values, precision=hi)
    return out.reshape(b, h, n, dh).astype(q.dtype)


def tree_attention(q, k_new, v_new, cache_k, cache_v, cache_lengths, ancestors, *, impl: str = "auto",
                   variant: str | None = None, interpret: bool | None = None,
                   block_sizes: BlockSizes | None = None):
    """Tree verification attention (see README.md).

    q [B, H, N, Dh], k_new/v_new [B, Hkv, N, Dh] (the nodes' own K/V), cache_k/cache_v
    [B, Hkv, S, Dh], cache_lengths int [B], ancestors bool [B, N, N] (row i: the
    nodes node i sees). Returns [B, H, N, Dh] in q's dtype.

    impl/variant/interpret: see `pallas_kernels.common.choose_kernel` ("xla" is
    `tree_attention_reference`). block_sizes: `verify_attention.BlockSizes`, default
    `BlockSizes.for_variant(variant)`; the cache tile must divide S (README.md).
    """
    b, h, n, dh, hkv, s = _check_shapes(q, k_new, v_new, cache_k, cache_v, cache_lengths, ancestors)
    choice = choose_kernel(impl, variant, interpret)
    if not choice.use_pallas or n == 0:
        return tree_attention_reference(q, k_new, v_new, cache_k, cache_v, cache_lengths, ancestors)
    kind = choice.variant
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None; got {type(block_sizes).__name__}")
    sizes = (block_sizes or BlockSizes.for_variant(kind)).validate(kind)
    if s < 1:
        raise ValueError("the cache must have at least one slot (S >= 1)")
    if kind == "gpu" and not is_triton_tile(dh):
        raise ValueError(f"the GPU kernel needs a power-of-two head dim >= 16; got Dh={dh}")
    block_kv = divisor_tile(s, sizes.block_kv, kind, jnp.dtype(cache_k.dtype).itemsize)

    g = h // hkv
    dtype = q.dtype
    if kind == "tpu":
        rows = round_up(g * n, sublane_align(dtype))  # whole sublane tiles
        keys = round_up(n, 128)  # a lane-aligned [R, 128] score tile for the nodes
    else:
        rows = max(16, next_pow2(g * n))
        keys = max(16, next_pow2(n))
    # Query row r of a kv head is head r // N of its group, node r % N: a free reshape of q.
    q_rows = jnp.pad(q.reshape(b, hkv, g * n, dh), ((0, 0), (0, 0), (0, rows - g * n), (0, 0)))

    def node_keys(x):  # [B, Hkv, N, Dh] -> [B, Hkv, keys, Dh]
        return jnp.pad(x.astype(dtype), ((0, 0), (0, 0), (0, keys - n), (0, 0)))

    node_mask = jnp.tile(ancestors.astype(jnp.int32), (1, g, 1))  # [B, G·N, N], padding rows see nothing
    node_mask = jnp.pad(node_mask, ((0, 0), (0, rows - g * n), (0, keys - n)))
    eff_len = jnp.clip(cache_lengths.astype(jnp.int32), 0, s)
    args = (q_rows, cache_k, cache_v, node_keys(k_new), node_keys(v_new), node_mask, eff_len)
    common = {"block_kv": block_kv, "scale": 1.0 / math.sqrt(dh), "interpret": choice.interpret}
    if kind == "tpu":
        out = tpu_tree_attention(*args, **common)
    else:
        out = gpu_tree_attention(*args, **common, num_warps=sizes.num_warps, num_stages=sizes.num_stages)
    return out[:, :, :g * n].reshape(b, h, n, dh)

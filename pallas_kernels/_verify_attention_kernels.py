"""The TPU (Mosaic) and GPU (Triton) kernels behind `verify_attention` and `tree_attention`.

One program per (row, kv head): the row's live cache tiles stream through an
online softmax, then the row's own new keys are folded in under a mask over
them. The two ops differ only in that mask (causal for a verified chain, the
ancestor mask for a tree), so they share these kernels and pass the mask's rule
as `new_key_mask(rows, keys, mask_block) -> bool [rows, keys]`. Inputs arrive
gathered per row by the ops; pallas_kernels/README.md describes the layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tiling import DOT_NN, DOT_NT, dot

_NEG = -1e30  # finite "minus infinity": no inf - inf NaNs in the running max


# ------------------------------------------------------------------ shared kernel math


def _exact_dot(a, b, dims):
    """float32 accumulation; float32 operands multiply in full float32, as in the reference."""
    return dot(a, b, dims, jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None)


def _online_update(m_prev, l_prev, acc_prev, scores, mask, v):
    """One flash step: folds masked float32 scores [R, T] and values [T, Dh] into (m, l, acc)."""
    scores = jnp.where(mask, scores, _NEG)
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(scores - m_next), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_next = alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)
    acc_next = alpha * acc_prev + _exact_dot(p.astype(v.dtype), v, DOT_NN)
    return m_next, l_next, acc_next


def _new_key_mask(rows: int, keys: int, group: int, key_ok):
    """[rows, keys]: key u visible to query row r (token r // group) iff u·group <= r and u is present."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 0)
    u = jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 1)
    return (u * group <= r) & (key_ok != 0)


def _finish(l, acc):
    return acc / jnp.where(l > 0.0, l, 1.0)


# ------------------------------------------------------------------ TPU (Mosaic)


def _tpu_kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, m_sc, l_sc, acc_sc, *,
                block_kv: int, num_tiles: int, scale: float, new_key_mask):
    b, j = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def fold(keys, values, mask):
        q = q_ref[...]
        scores = _exact_dot(q, keys.astype(q.dtype), DOT_NT) * scale
        m, l, acc = _online_update(m_sc[...], l_sc[...], acc_sc[...], scores, mask, values.astype(q.dtype))
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    @pl.when((j < num_tiles) & (j * block_kv < length))
    def _cache_tile():
        rows = q_ref.shape[0]
        pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        fold(k_ref[...], v_ref[...], pos < length)

    @pl.when(j == num_tiles)
    def _new_keys_and_write():
        rows, keys = q_ref.shape[0], kn_ref.shape[0]
        fold(kn_ref[...], vn_ref[...], new_key_mask(rows, keys, mask_ref[...]))
        o_ref[...] = _finish(l_sc[...], acc_sc[...]).astype(o_ref.dtype)


def tpu_cached_attention(q_rows, cache_k, cache_v, k_rows, v_rows, mask_src, eff_len, *, block_kv, scale,
                         interpret, new_key_mask, name):
    """Grid (row, kv head, cache tile + 1): lengths scalar-prefetched, the last step takes the new keys.

    mask_src [B, M, keys] int32 is read whole per row and handed to `new_key_mask`."""
    b, hkv, rows, dh = q_rows.shape
    s = cache_k.shape[2]
    keys = k_rows.shape[2]
    num_tiles = s // block_kv

    def cache_index(bi, hi, j, len_ref):
        last = jnp.maximum(pl.cdiv(len_ref[bi], block_kv) - 1, 0)  # the row's last live tile
        return bi, hi, jnp.minimum(j, last), 0

    def per_head(bi, hi, j, len_ref):
        return bi, hi, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, hkv, num_tiles + 1),
        in_specs=[
            pl.BlockSpec((None, None, rows, dh), per_head),
            pl.BlockSpec((None, None, block_kv, dh), cache_index),
            pl.BlockSpec((None, None, block_kv, dh), cache_index),
            pl.BlockSpec((None, None, keys, dh), per_head),
            pl.BlockSpec((None, None, keys, dh), per_head),
            pl.BlockSpec((None,) + mask_src.shape[1:], lambda bi, hi, j, len_ref: (bi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, dh), per_head),
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, dh), jnp.float32)],
    )
    kernel = functools.partial(_tpu_kernel, block_kv=block_kv, num_tiles=num_tiles, scale=scale,
                               new_key_mask=new_key_mask)
    itemsize = jnp.dtype(cache_k.dtype).itemsize
    cost = pl.CostEstimate(
        flops=4 * b * hkv * rows * (s + keys) * dh,
        transcendentals=b * hkv * rows * (s + keys),
        bytes_accessed=2 * b * hkv * s * dh * itemsize
        + (2 * q_rows.size + 2 * k_rows.size) * q_rows.dtype.itemsize + 4 * mask_src.size,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name=name,
    )(eff_len, q_rows, cache_k, cache_v, k_rows, v_rows, mask_src)


# ------------------------------------------------------------------ GPU (Triton)


def _gpu_kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, *, block_kv: int,
                scale: float, new_key_mask):
    length = len_ref[...]
    q = q_ref[...]
    rows, dh = q.shape

    def fold(carry, keys, values, mask):
        m, l, acc = carry
        scores = _exact_dot(q, keys.astype(q.dtype), DOT_NT) * scale
        return _online_update(m, l, acc, scores, mask, values.astype(q.dtype))

    def cache_tile(t, carry):
        start = pl.multiple_of(t * block_kv, block_kv)
        window = pl.ds(start, block_kv)
        pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        return fold(carry, k_ref[window, :], v_ref[window, :], pos < length)

    carry = (jnp.full((rows, 1), _NEG, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
             jnp.zeros((rows, dh), jnp.float32))
    carry = jax.lax.fori_loop(0, pl.cdiv(length, block_kv), cache_tile, carry)
    keys = kn_ref.shape[0]
    _, l, acc = fold(carry, kn_ref[...], vn_ref[...], new_key_mask(rows, keys, mask_ref[...]))
    o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


def gpu_cached_attention(q_rows, cache_k, cache_v, k_rows, v_rows, mask_src, eff_len, *, block_kv, scale,
                         interpret, new_key_mask, name, num_warps, num_stages):
    """Grid (row, kv head); each program loops over its row's live cache tiles.

    mask_src [B, ...] int32 is read whole per row and handed to `new_key_mask`."""
    b, hkv, rows, dh = q_rows.shape
    s = cache_k.shape[2]
    keys = k_rows.shape[2]

    def per_head(bi, hi):
        return bi, hi, 0, 0

    kernel = functools.partial(_gpu_kernel, block_kv=block_kv, scale=scale, new_key_mask=new_key_mask)
    mask_zeros = (0,) * (mask_src.ndim - 1)
    return pl.pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=[
            pl.BlockSpec((None,), lambda bi, hi: (bi,)),
            pl.BlockSpec((None, None, rows, dh), per_head),
            pl.BlockSpec((None, None, s, dh), per_head),
            pl.BlockSpec((None, None, s, dh), per_head),
            pl.BlockSpec((None, None, keys, dh), per_head),
            pl.BlockSpec((None, None, keys, dh), per_head),
            pl.BlockSpec((None,) + mask_src.shape[1:], lambda bi, hi: (bi,) + mask_zeros),
        ],
        out_specs=pl.BlockSpec((None, None, rows, dh), per_head),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(eff_len, q_rows, cache_k, cache_v, k_rows, v_rows, mask_src)


# ------------------------------------------------------------------ the two ops


def causal_new_key_mask(group: int):
    """verify_attention's rule; its mask_src is key_ok (1 where the row's token is present)."""
    return lambda rows, keys, key_ok: _new_key_mask(rows, keys, group, key_ok.reshape(1, keys))


def ancestor_new_key_mask(rows, keys, node_mask):
    """tree_attention's rule; its mask_src is the ancestor mask per query row, [rows, keys]."""
    return node_mask != 0


def tpu_verify_attention(q_rows, cache_k, cache_v, k_rows, v_rows, key_ok, eff_len, *, group, **kw):
    return tpu_cached_attention(q_rows, cache_k, cache_v, k_rows, v_rows, key_ok[:, None, :], eff_len,
                                new_key_mask=causal_new_key_mask(group), name="verify_attention_tpu", **kw)


def gpu_verify_attention(q_rows, cache_k, cache_v, k_rows, v_rows, key_ok, eff_len, *, group, **kw):
    return gpu_cached_attention(q_rows, cache_k, cache_v, k_rows, v_rows, key_ok, eff_len,
                                new_key_mask=causal_new_key_mask(group), name="verify_attention_gpu", **kw)


def tpu_tree_attention(*args, **kw):
    return tpu_cached_attention(*args, new_key_mask=ancestor_new_key_mask, name="tree_attention_tpu", **kw)


def gpu_tree_attention(*args, **kw):
    return gpu_cached_attention(*args, new_key_mask=ancestor_new_key_mask, name="tree_attention_gpu", **kw)

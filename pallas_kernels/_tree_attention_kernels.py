"""The TPU (Mosaic) and GPU (Triton) kernels behind `pallas_kernels.tree_attention`.

One program per (row, kv head), as in `_verify_attention_kernels`: the row's
live cache tiles stream through an online softmax, then the row's tree nodes
are folded in under the row's ancestor mask (given per query row, already
expanded over the heads of the group). The online-softmax step is the verify
kernel's, so both kernels agree on every number they compute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._verify_attention_kernels import _NEG, _exact_dot, _finish, _online_update
from pallas_kernels.tiling import DOT_NT

# ------------------------------------------------------------------ TPU (Mosaic)


def _tpu_kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, m_sc, l_sc, acc_sc, *,
                block_kv: int, num_tiles: int, scale: float):
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
    def _tree_nodes_and_write():
        fold(kn_ref[...], vn_ref[...], mask_ref[...] != 0)
        o_ref[...] = _finish(l_sc[...], acc_sc[...]).astype(o_ref.dtype)


def tpu_tree_attention(q_rows, cache_k, cache_v, k_rows, v_rows, node_mask, eff_len, *, block_kv, scale,
                       interpret):
    """Grid (row, kv head, cache tile + 1): lengths scalar-prefetched, the last step takes the nodes."""
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
            pl.BlockSpec((None, rows, keys), lambda bi, hi, j, len_ref: (bi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, dh), per_head),
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, dh), jnp.float32)],
    )
    kernel = functools.partial(_tpu_kernel, block_kv=block_kv, num_tiles=num_tiles, scale=scale)
    itemsize = jnp.dtype(cache_k.dtype).itemsize
    cost = pl.CostEstimate(
        flops=4 * b * hkv * rows * (s + keys) * dh,
        transcendentals=b * hkv * rows * (s + keys),
        bytes_accessed=2 * b * hkv * s * dh * itemsize
        + (2 * q_rows.size + 2 * k_rows.size) * q_rows.dtype.itemsize + 4 * node_mask.size,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="tree_attention_tpu",
    )(eff_len, q_rows, cache_k, cache_v, k_rows, v_rows, node_mask)


# ------------------------------------------------------------------ GPU (Triton)


def _gpu_kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, *, block_kv: int,
                scale: float):
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
    _, l, acc = fold(carry, kn_ref[...], vn_ref[...], mask_ref[...] != 0)
    o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


def gpu_tree_attention(q_rows, cache_k, cache_v, k_rows, v_rows, node_mask, eff_len, *, block_kv, scale,
                       interpret, num_warps, num_stages):
    """Grid (row, kv head); each program loops over its row's live cache tiles."""
    b, hkv, rows, dh = q_rows.shape
    s = cache_k.shape[2]
    keys = k_rows.shape[2]

    def per_head(bi, hi):
        return bi, hi, 0, 0

    kernel = functools.partial(_gpu_kernel, block_kv=block_kv, scale=scale)
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
            pl.BlockSpec((None, rows, keys), lambda bi, hi: (bi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, dh), per_head),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_attention_gpu",
    )(eff_len, q_rows, cache_k, cache_v, k_rows, v_rows, node_mask)

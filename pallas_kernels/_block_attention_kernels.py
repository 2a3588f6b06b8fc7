"""The TPU (Mosaic) and GPU (Triton) kernels behind `pallas_kernels.block_attention`.

Inputs arrive padded and grouped by `block_attention`: q [B, Hkv, rows, Dp]
(the query heads of a KV group folded into rows), the block's keys
[B, Hkv, Bs_p, Dp], the context [B, Hkv, S_p, Dp] and lengths clipped to [0, S].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.attention_tiles import cdiv, key_range_mask, load_state, online_step, store_state
from pallas_kernels.tiling import LANES

# --------------------------------------------------------------------------- TPU kernel


def _tpu_kernel(lens_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, m_sc, l_sc, acc_sc, *,
                scale, block_kv, num_kv):
    b, j = pl.program_id(0), pl.program_id(3)
    length = lens_ref[b]
    rows = q_ref.shape[0]

    @pl.when(j == 0)
    def _block_keys():
        store_state(m_sc, l_sc, acc_sc, online_step(q_ref[...], kb_ref[...], vb_ref[...], None, None, scale))

    def context(masked):
        mask = key_range_mask(rows, block_kv, j * block_kv, length) if masked else None
        state = load_state(m_sc, l_sc, acc_sc)
        store_state(m_sc, l_sc, acc_sc, online_step(q_ref[...], kc_ref[...], vc_ref[...], mask, state, scale))

    pl.when((j + 1) * block_kv <= length)(functools.partial(context, False))
    pl.when((j * block_kv < length) & ((j + 1) * block_kv > length))(functools.partial(context, True))

    @pl.when(j == num_kv - 1)
    def _finish():
        o_ref[...] = (acc_sc[...] / l_sc[:, :1]).astype(o_ref.dtype)


def tpu_block_attention(q, kb, vb, kc, vc, lens, *, bq, bkv, scale, interpret):
    """Grid (batch, kv head, query tile, context tile); lengths scalar-prefetched."""
    from jax.experimental.pallas import tpu as pltpu

    b, hkv, rows, d = q.shape
    nq, nk = rows // bq, kc.shape[2] // bkv

    def ctx_map(bi, h, i, j, lens_ref):
        last = jnp.maximum(cdiv(lens_ref[bi], bkv) - 1, 0)
        return bi, h, jnp.minimum(j, last), 0

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j, _: (bi, h, i, 0))
    blk_spec = pl.BlockSpec((None, None, kb.shape[2], d), lambda bi, h, i, j, _: (bi, h, 0, 0))
    ctx_spec = pl.BlockSpec((None, None, bkv, d), ctx_map)
    kernel = functools.partial(_tpu_kernel, scale=scale, block_kv=bkv, num_kv=nk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, hkv, nq, nk),
            in_specs=[q_spec, blk_spec, blk_spec, ctx_spec, ctx_spec], out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                            pltpu.VMEM((bq, d), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="block_attention_tpu",
    )(lens, q, kb, vb, kc, vc)


# --------------------------------------------------------------------------- GPU (Triton) kernel


def _gpu_kernel(len_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, *, scale, block_kv, bs):
    length = len_ref[...]
    q = q_ref[...]
    rows, cols = q.shape[0], kb_ref.shape[0]
    own = key_range_mask(rows, cols, 0, bs) if bs < cols else None
    state = online_step(q, kb_ref[...], vb_ref[...], own, None, scale)

    def body(t, st, masked):
        start = pl.multiple_of(t * block_kv, block_kv)
        mask = key_range_mask(rows, block_kv, start, length) if masked else None
        k, v = kc_ref[pl.ds(start, block_kv), :], vc_ref[pl.ds(start, block_kv), :]
        return online_step(q, k, v, mask, st, scale)

    full = lax.div(length, block_kv)
    state = lax.fori_loop(0, full, functools.partial(body, masked=False), state)
    state = lax.fori_loop(full, cdiv(length, block_kv), functools.partial(body, masked=True),
                          state)
    _, lsum, acc = state
    o_ref[...] = (acc / lsum).astype(o_ref.dtype)


def gpu_block_attention(q, kb, vb, kc, vc, lens, *, bq, bkv, bs, scale, interpret, sizes):
    """Grid (batch, kv head, query tile); each program loops over its row's live context tiles."""
    from jax.experimental.pallas import triton as pltriton

    b, hkv, rows, d = q.shape
    kernel = functools.partial(_gpu_kernel, scale=scale, block_kv=bkv, bs=bs)
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, h, i: (bi, h, i, 0))

    def whole(n):  # the whole key axis of one (row, kv head)
        return pl.BlockSpec((None, None, n, d), lambda bi, h, i: (bi, h, 0, 0))

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b, hkv, rows // bq),
        in_specs=[pl.BlockSpec((None,), lambda bi, h, i: (bi,)), q_spec, whole(kb.shape[2]),
                  whole(kb.shape[2]), whole(kc.shape[2]), whole(kc.shape[2])],
        out_specs=q_spec,
        compiler_params=pltriton.CompilerParams(num_warps=sizes.warps(d), num_stages=sizes.num_stages),
        interpret=interpret, name="block_attention_gpu",
    )(lens, q, kb, vb, kc, vc)

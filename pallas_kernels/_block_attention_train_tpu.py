"""TPU (Mosaic) kernels of `pallas_kernels.block_attention_train`: forward, dq, d(ctx k/v), d(blk k/v).

All four use `pltpu.PrefetchScalarGridSpec`: the block maps (and the anchors)
are scalar-prefetched, flattened to 1-D so their SMEM footprint is their size
whatever SMEM's tiling of 2-D arrays. Index maps clamp skipped context tiles
to the last visited one, so the pipeline fetches nothing for them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._block_attention_train_layout import TrainGeometry, block_map, visit_lists
from pallas_kernels.attention_tiles import (dkv_tile, dq_tile, key_range_mask, load_state, online_step, own_block_mask,
                                            store_state, write_dkv)
from pallas_kernels.tiling import LANES


def _params(*semantics):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics)


def _context_mask(anchors_ref, geo: TrainGeometry, b, i, j, nb, bq, bkv):
    """bool [bq, bkv]: which keys of context tile j each row of query tile i (nb blocks) sees."""
    r = lax.broadcasted_iota(jnp.int32, (bq, bkv), 0)
    first = b * geo.n_pad + i * nb
    lim = jnp.full((bq, bkv), anchors_ref[first], jnp.int32)
    for k in range(1, nb):
        lim = jnp.where(r >= k * geo.bs_p, anchors_ref[first + k], lim)
    return key_range_mask(bq, bkv, j * bkv, lim)


def _query_grid(q, anchors_p, geo: TrainGeometry, nb, bq, bkv):
    """What a (batch, head, query tile, context tile) call needs: the scalar-prefetch operands
    (block map and anchors), the grid, and the BlockSpecs of the query tile, its own blocks' keys,
    the context tile of the head's kv head (clamped to the last visited one) and the
    lane-replicated row statistics."""
    b, h, rows, d = q.shape
    g, nq = geo.group, rows // bq
    counts, full = block_map(anchors_p, nb, bkv)
    prefetch = (counts.reshape(-1), full.reshape(-1), anchors_p.reshape(-1))
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    blk_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j, *_: (bi, lax.div(hi, g), i, 0))
    ctx_spec = pl.BlockSpec((None, None, bkv, d), lambda bi, hi, i, j, c, *_: (
        bi, lax.div(hi, g), jnp.minimum(j, jnp.maximum(c[bi * nq + i] - 1, 0)), 0))
    row_spec = pl.BlockSpec((None, None, bq, LANES), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    return prefetch, (b, h, nq, geo.t_pad // bkv), (q_spec, blk_spec, ctx_spec, row_spec)


def _query_tile_steps(j, full, count, own, context, finish):
    """The steps of a (batch, head, query tile, context tile j) program: the tile's own blocks at
    j = 0, then context(masked=False) below `full`, context(masked=True) up to `count`, and
    finish() at the last j. The order matters: at j = 0 the own blocks come first."""
    pl.when(j == 0)(own)
    pl.when(j < full)(functools.partial(context, False))
    pl.when((j >= full) & (j < count))(functools.partial(context, True))
    pl.when(j == pl.num_programs(3) - 1)(finish)


# --------------------------------------------------------------------------- forward


def _fwd_kernel(counts_ref, full_ref, anchors_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, lse_ref,
                m_sc, l_sc, acc_sc, *, geo):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tile = b * pl.num_programs(2) + i
    count, full, bq, bkv = counts_ref[tile], full_ref[tile], geo.bq, geo.bkv

    def own():
        mask = own_block_mask(bq, geo.nb, geo.bs, geo.bs_p)
        store_state(m_sc, l_sc, acc_sc, online_step(q_ref[...], kb_ref[...], vb_ref[...], mask, None, geo.scale))

    def context(masked):
        mask = _context_mask(anchors_ref, geo, b, i, j, geo.nb, bq, bkv) if masked else None
        state = load_state(m_sc, l_sc, acc_sc)
        store_state(m_sc, l_sc, acc_sc,
                    online_step(q_ref[...], kc_ref[...], vc_ref[...], mask, state, geo.scale))

    def finish():
        o_ref[...] = (acc_sc[...] / l_sc[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])

    _query_tile_steps(j, full, count, own, context, finish)


def tpu_forward(q, kb, vb, kc, vc, anchors_p, geo: TrainGeometry):
    """-> (o [B, H, rows, Dp], lse [B, H, rows, LANES] float32)."""
    from jax.experimental.pallas import tpu as pltpu

    b, h, rows, d = q.shape
    bq = geo.bq
    prefetch, grid, (q_spec, blk_spec, ctx_spec, lse_spec) = _query_grid(q, anchors_p, geo, geo.nb, bq, geo.bkv)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, h, rows, LANES), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=grid,
            in_specs=[q_spec, blk_spec, blk_spec, ctx_spec, ctx_spec], out_specs=(q_spec, lse_spec),
            scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                            pltpu.VMEM((bq, d), jnp.float32)]),
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=geo.interpret, name="block_attention_train_fwd_tpu",
    )(*prefetch, q, kb, vb, kc, vc)


# --------------------------------------------------------------------------- backward


def _dq_kernel(counts_ref, full_ref, anchors_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, do_ref, lse_ref,
               delta_ref, dq_ref, acc_sc, *, geo):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tile = b * pl.num_programs(2) + i
    count, full, bq, bkv = counts_ref[tile], full_ref[tile], geo.bq_b, geo.bkv_b

    def tile(k, v, mask):
        return dq_tile(q_ref[...], k, v, do_ref[...], lse_ref[:, :1], delta_ref[:, :1], mask, geo.scale)

    def own():
        acc_sc[...] = tile(kb_ref[...], vb_ref[...], own_block_mask(bq, geo.nb_b, geo.bs, geo.bs_p))

    def context(masked):
        mask = _context_mask(anchors_ref, geo, b, i, j, geo.nb_b, bq, bkv) if masked else None
        acc_sc[...] += tile(kc_ref[...], vc_ref[...], mask)

    def finish():
        dq_ref[...] = (acc_sc[...] * geo.scale).astype(dq_ref.dtype)

    _query_tile_steps(j, full, count, own, context, finish)


def tpu_dq(q, kb, vb, kc, vc, do, lse, delta, anchors_p, geo: TrainGeometry):
    from jax.experimental.pallas import tpu as pltpu

    d, bq = q.shape[3], geo.bq_b
    prefetch, grid, (q_spec, blk_spec, ctx_spec, row_spec) = _query_grid(q, anchors_p, geo, geo.nb_b, bq, geo.bkv_b)
    return pl.pallas_call(
        functools.partial(_dq_kernel, geo=geo),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=grid,
            in_specs=[q_spec, blk_spec, blk_spec, ctx_spec, ctx_spec, q_spec, row_spec, row_spec],
            out_specs=q_spec, scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=geo.interpret, name="block_attention_train_dq_tpu",
    )(*prefetch, q, kb, vb, kc, vc, do, lse, delta)


def _dkv_ctx_kernel(qlist_ref, qcount_ref, full_ref, anchors_ref, q_ref, kc_ref, vc_ref, do_ref, lse_ref,
                    delta_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, geo):
    b, j, gi, t = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    bq, bkv = geo.bq_b, geo.bkv_b
    nk, nq = pl.num_programs(2), pl.num_programs(4)
    i = qlist_ref[(b * nk + j) * nq + t]
    visits = t < qcount_ref[b * nk + j]
    unmasked = j < full_ref[b * nq + i]

    @pl.when((gi == 0) & (t == 0))
    def _zero():
        dk_sc[...] = jnp.zeros_like(dk_sc)
        dv_sc[...] = jnp.zeros_like(dv_sc)

    def step(masked):
        mask = _context_mask(anchors_ref, geo, b, i, j, geo.nb_b, bq, bkv) if masked else None
        dk, dv = dkv_tile(q_ref[...], kc_ref[...], vc_ref[...], do_ref[...], lse_ref[:, :1],
                          delta_ref[:, :1], mask, geo.scale)
        dk_sc[...] += dk
        dv_sc[...] += dv

    pl.when(visits & unmasked)(functools.partial(step, False))
    pl.when(visits & ~unmasked)(functools.partial(step, True))

    @pl.when((gi == pl.num_programs(3) - 1) & (t == pl.num_programs(4) - 1))
    def _finish():
        write_dkv(dk_ref, dv_ref, dk_sc[...], dv_sc[...], geo.scale)


def tpu_dkv_ctx(q, kc, vc, do, lse, delta, anchors_p, geo: TrainGeometry):
    """Grid (batch, kv head, context tile, head of the group, visiting query tile)."""
    from jax.experimental.pallas import tpu as pltpu

    b, _, rows, d = q.shape
    g, bq, bkv = geo.group, geo.bq_b, geo.bkv_b
    hkv, nk, nq = kc.shape[1], geo.t_pad // bkv, rows // bq
    counts, full = block_map(anchors_p, geo.nb_b, bkv)
    qlist, qcount = visit_lists(counts, nk)

    def q_map(bi, kh, j, gi, t, ql, *_):
        return bi, kh * g + gi, ql[(bi * nk + j) * nq + t], 0

    q_spec = pl.BlockSpec((None, None, bq, d), q_map)
    row_spec = pl.BlockSpec((None, None, bq, LANES), q_map)
    kv_spec = pl.BlockSpec((None, None, bkv, d), lambda bi, kh, j, gi, t, *_: (bi, kh, j, 0))
    return pl.pallas_call(
        functools.partial(_dkv_ctx_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(b, hkv, nk, g, nq),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec], out_specs=(kv_spec, kv_spec),
            scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)]),
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=geo.interpret, name="block_attention_train_dkv_ctx_tpu",
    )(qlist.reshape(-1), qcount.reshape(-1), full.reshape(-1), anchors_p.reshape(-1), q, kc, vc, do, lse,
      delta)


def _dkv_blk_kernel(q_ref, kb_ref, vb_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, geo):
    gi = pl.program_id(3)

    @pl.when(gi == 0)
    def _zero():
        dk_sc[...] = jnp.zeros_like(dk_sc)
        dv_sc[...] = jnp.zeros_like(dv_sc)

    own = own_block_mask(geo.bq_b, geo.nb_b, geo.bs, geo.bs_p)
    dk, dv = dkv_tile(q_ref[...], kb_ref[...], vb_ref[...], do_ref[...], lse_ref[:, :1], delta_ref[:, :1],
                      own, geo.scale)
    dk_sc[...] += dk
    dv_sc[...] += dv

    @pl.when(gi == pl.num_programs(3) - 1)
    def _finish():
        write_dkv(dk_ref, dv_ref, dk_sc[...], dv_sc[...], geo.scale)


def tpu_dkv_blk(q, kb, vb, do, lse, delta, geo: TrainGeometry):
    """Grid (batch, kv head, block tile, head of the group)."""
    from jax.experimental.pallas import tpu as pltpu

    b, _, rows, d = q.shape
    g, bq = geo.group, geo.bq_b
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, kh, i, gi: (bi, kh * g + gi, i, 0))
    row_spec = pl.BlockSpec((None, None, bq, LANES), lambda bi, kh, i, gi: (bi, kh * g + gi, i, 0))
    kv_spec = pl.BlockSpec((None, None, bq, d), lambda bi, kh, i, gi: (bi, kh, i, 0))
    return pl.pallas_call(
        functools.partial(_dkv_blk_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(kb.shape, kb.dtype), jax.ShapeDtypeStruct(vb.shape, vb.dtype)),
        grid=(b, kb.shape[1], rows // bq, g),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec], out_specs=(kv_spec, kv_spec),
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32), pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=geo.interpret, name="block_attention_train_dkv_blk_tpu",
    )(q, kb, vb, do, lse, delta)

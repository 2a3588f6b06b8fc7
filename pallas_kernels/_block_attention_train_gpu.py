"""GPU (Pallas Triton) kernels of `pallas_kernels.block_attention_train`: forward, dq, d(ctx k/v), d(blk k/v).

No scalar prefetch on Triton: the block maps and the per-row anchors are
ordinary inputs, and each program runs in-kernel `lax.fori_loop`s whose trip
counts come from the block map, so skipped context tiles cost nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._block_attention_train_layout import TrainGeometry, block_map, visit_lists
from pallas_kernels.attention_tiles import dkv_tile, dq_tile, key_range_mask, online_step, own_block_mask, write_dkv


def _params(geo: TrainGeometry):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=geo.sizes.warps(geo.d_p), num_stages=geo.sizes.num_stages)


def _query_grid_specs(geo: TrainGeometry, bq, d):
    """BlockSpecs of a (batch, head, query tile) grid: the tile's block-map entry, its rows'
    anchors, the query tile, its own blocks' keys and the whole context of the head's kv head."""
    g = geo.group
    scalar = pl.BlockSpec((None, None), lambda bi, hi, i: (bi, i))
    limits = pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i))
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, hi, i, 0))
    blk_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, lax.div(hi, g), i, 0))
    ctx_spec = pl.BlockSpec((None, None, geo.t_pad, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0))
    return scalar, limits, q_spec, blk_spec, ctx_spec


def _context_loops(body, full_ref, count_ref, carry):
    """Runs body(t, carry, masked) over the unmasked context tiles, then over the masked ones."""
    full = full_ref[...]
    carry = lax.fori_loop(0, full, functools.partial(body, masked=False), carry)
    return lax.fori_loop(full, count_ref[...], functools.partial(body, masked=True), carry)


# --------------------------------------------------------------------------- forward


def _fwd_kernel(count_ref, full_ref, lim_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, lse_ref, *, geo):
    q, bq, bkv = q_ref[...], geo.bq, geo.bkv
    lim = lim_ref[...][:, None]
    own = own_block_mask(bq, geo.nb, geo.bs, geo.bs_p)
    state = online_step(q, kb_ref[...], vb_ref[...], own, None, geo.scale)

    def body(t, st, masked):
        start = pl.multiple_of(t * bkv, bkv)
        mask = key_range_mask(bq, bkv, start, lim) if masked else None
        return online_step(q, kc_ref[pl.ds(start, bkv), :], vc_ref[pl.ds(start, bkv), :], mask, st, geo.scale)

    m, lsum, acc = _context_loops(body, full_ref, count_ref, state)
    o_ref[...] = (acc / lsum).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log(lsum))[:, 0]


def gpu_forward(q, kb, vb, kc, vc, anchors_p, lim, geo: TrainGeometry):
    """-> (o [B, H, rows, Dp], lse [B, H, rows] float32)."""
    b, h, rows, d = q.shape
    bq = geo.bq
    counts, full = block_map(anchors_p, geo.nb, geo.bkv)
    scalar, limits, q_spec, blk_spec, ctx_spec = _query_grid_specs(geo, bq, d)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, rows), jnp.float32)),
        grid=(b, h, rows // bq),
        in_specs=[scalar, scalar, limits, q_spec, blk_spec, blk_spec, ctx_spec, ctx_spec],
        out_specs=(q_spec, pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i))),
        compiler_params=_params(geo), interpret=geo.interpret, name="block_attention_train_fwd_gpu",
    )(counts, full, lim, q, kb, vb, kc, vc)


# --------------------------------------------------------------------------- backward


def _dq_kernel(count_ref, full_ref, lim_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, geo):
    q, do, bq, bkv = q_ref[...], do_ref[...], geo.bq_b, geo.bkv_b
    lse, delta, lim = lse_ref[...][:, None], delta_ref[...][:, None], lim_ref[...][:, None]
    own = own_block_mask(bq, geo.nb_b, geo.bs, geo.bs_p)
    acc = dq_tile(q, kb_ref[...], vb_ref[...], do, lse, delta, own, geo.scale)

    def body(t, acc, masked):
        start = pl.multiple_of(t * bkv, bkv)
        mask = key_range_mask(bq, bkv, start, lim) if masked else None
        k, v = kc_ref[pl.ds(start, bkv), :], vc_ref[pl.ds(start, bkv), :]
        return acc + dq_tile(q, k, v, do, lse, delta, mask, geo.scale)

    acc = _context_loops(body, full_ref, count_ref, acc)
    dq_ref[...] = (acc * geo.scale).astype(dq_ref.dtype)


def gpu_dq(q, kb, vb, kc, vc, do, lse, delta, anchors_p, lim, geo: TrainGeometry):
    b, h, rows, d = q.shape
    bq = geo.bq_b
    counts, full = block_map(anchors_p, geo.nb_b, geo.bkv_b)
    scalar, limits, q_spec, blk_spec, ctx_spec = _query_grid_specs(geo, bq, d)
    row_spec = pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i))
    return pl.pallas_call(
        functools.partial(_dq_kernel, geo=geo),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b, h, rows // bq),
        in_specs=[scalar, scalar, limits, q_spec, blk_spec, blk_spec, ctx_spec, ctx_spec, q_spec, row_spec,
                  row_spec],
        out_specs=q_spec,
        compiler_params=_params(geo), interpret=geo.interpret, name="block_attention_train_dq_gpu",
    )(counts, full, lim, q, kb, vb, kc, vc, do, lse, delta)


def _dkv_ctx_kernel(qlist_ref, qcount_ref, lim_ref, q_ref, kc_ref, vc_ref, do_ref, lse_ref, delta_ref,
                    dk_ref, dv_ref, *, geo):
    j = pl.program_id(2)
    k, v, bq, bkv = kc_ref[...], vc_ref[...], geo.bq_b, geo.bkv_b
    zeros = jnp.zeros(k.shape, jnp.float32)

    def per_tile(t, carry, gi):
        start = pl.multiple_of(qlist_ref[t] * bq, bq)
        rows = pl.ds(start, bq)
        mask = key_range_mask(bq, bkv, j * bkv, lim_ref[rows][:, None])
        dk, dv = dkv_tile(q_ref[gi, rows, :], k, v, do_ref[gi, rows, :], lse_ref[gi, rows][:, None],
                          delta_ref[gi, rows][:, None], mask, geo.scale)
        return carry[0] + dk, carry[1] + dv

    def per_head(gi, carry):
        return lax.fori_loop(0, qcount_ref[...], functools.partial(per_tile, gi=gi), carry)

    dk, dv = lax.fori_loop(0, geo.group, per_head, (zeros, zeros))
    write_dkv(dk_ref, dv_ref, dk, dv, geo.scale)


def gpu_dkv_ctx(q, kc, vc, do, lse, delta, anchors_p, lim, geo: TrainGeometry):
    """Grid (batch, kv head, context tile); loops over the group's heads and the visiting query tiles."""
    b, _, rows, d = q.shape
    g, bkv = geo.group, geo.bkv_b
    hkv, nk, nq = kc.shape[1], geo.t_pad // bkv, rows // geo.bq_b
    counts, _ = block_map(anchors_p, geo.nb_b, bkv)
    qlist, qcount = visit_lists(counts, nk)
    group_spec = pl.BlockSpec((None, g, rows, d), lambda bi, kh, j: (bi, kh, 0, 0))
    group_rows = pl.BlockSpec((None, g, rows), lambda bi, kh, j: (bi, kh, 0))
    kv_spec = pl.BlockSpec((None, None, bkv, d), lambda bi, kh, j: (bi, kh, j, 0))
    return pl.pallas_call(
        functools.partial(_dkv_ctx_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype)),
        grid=(b, hkv, nk),
        in_specs=[pl.BlockSpec((None, None, nq), lambda bi, kh, j: (bi, j, 0)),
                  pl.BlockSpec((None, None), lambda bi, kh, j: (bi, j)),
                  pl.BlockSpec((None, rows), lambda bi, kh, j: (bi, 0)),
                  group_spec, kv_spec, kv_spec, group_spec, group_rows, group_rows],
        out_specs=(kv_spec, kv_spec),
        compiler_params=_params(geo), interpret=geo.interpret,
        name="block_attention_train_dkv_ctx_gpu",
    )(qlist, qcount, lim, q, kc, vc, do, lse, delta)


def _dkv_blk_kernel(q_ref, kb_ref, vb_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, geo):
    k, v = kb_ref[...], vb_ref[...]
    own = own_block_mask(geo.bq_b, geo.nb_b, geo.bs, geo.bs_p)
    zeros = jnp.zeros(k.shape, jnp.float32)

    def per_head(gi, carry):
        dk, dv = dkv_tile(q_ref[gi], k, v, do_ref[gi], lse_ref[gi][:, None], delta_ref[gi][:, None], own,
                          geo.scale)
        return carry[0] + dk, carry[1] + dv

    dk, dv = lax.fori_loop(0, geo.group, per_head, (zeros, zeros))
    write_dkv(dk_ref, dv_ref, dk, dv, geo.scale)


def gpu_dkv_blk(q, kb, vb, do, lse, delta, geo: TrainGeometry):
    """Grid (batch, kv head, block tile); loops over the group's heads."""
    b, _, rows, d = q.shape
    g, bq = geo.group, geo.bq_b
    group_spec = pl.BlockSpec((None, g, bq, d), lambda bi, kh, i: (bi, kh, i, 0))
    group_rows = pl.BlockSpec((None, g, bq), lambda bi, kh, i: (bi, kh, i))
    kv_spec = pl.BlockSpec((None, None, bq, d), lambda bi, kh, i: (bi, kh, i, 0))
    return pl.pallas_call(
        functools.partial(_dkv_blk_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(kb.shape, kb.dtype), jax.ShapeDtypeStruct(vb.shape, vb.dtype)),
        grid=(b, kb.shape[1], rows // bq),
        in_specs=[group_spec, kv_spec, kv_spec, group_spec, group_rows, group_rows],
        out_specs=(kv_spec, kv_spec),
        compiler_params=_params(geo), interpret=geo.interpret,
        name="block_attention_train_dkv_blk_gpu",
    )(q, kb, vb, do, lse, delta)

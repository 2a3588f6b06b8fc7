"""Block-sparse drafter attention for DFlash training: forward and backward Pallas kernels.

What it computes
----------------
Training drafts N blocks of Bs positions per sequence at once. With
q [B, H, N*Bs, Dh], ctx_k/ctx_v [B, Hkv, T, Dh] (the whole sequence's context
features), blk_k/blk_v [B, Hkv, N*Bs, Dh] and anchors int [B, N], the queries
of block n see the context positions < anchors[b, n] and the keys of their own
block (all of them): exactly `training.anchors.block_attention_mask` over the
concatenated keys (context ; blocks), one float32 softmax, scale 1/sqrt(Dh),
grouped-query heads. `block_attention_train` is differentiable in q, ctx_k,
ctx_v, blk_k and blk_v (`jax.custom_vjp`).

How
---
Forward: flash-style online softmax (shared with the inference kernel in
`pallas_kernels.block_attention`). A query tile holds whole blocks; its own
block keys are the same row range of blk_k/blk_v and are visited first (so no
row is ever fully masked); then the context tiles up to the tile's largest
anchor. A scalar-prefetched block map gives, per (sequence, query tile), the
number of context tiles to visit and the number that are fully visible (no
mask needed): fully masked tiles are neither fetched nor computed, so the cost
is Σ over query tiles of the tile's largest anchor (rounded up to a kv tile),
≈ Bs · Σ_n anchors[b, n] for sorted anchors, instead of N·Bs·T. The forward
saves the log-sum-exp per row.

Backward (flash-attention-2): delta = rowsum(o * do) (plain jnp: one fused
elementwise pass); then three kernels that recompute the probabilities from
the saved log-sum-exp, tile by tile:
- dq: grid over query tiles, loop over (own block ; visited context tiles);
- d(ctx_k, ctx_v): grid over context tiles, loop over the query heads of the
  KV group and over only the query tiles that see the tile (a compacted,
  scalar-prefetched list per context tile: block-sparse in the backward too);
- d(blk_k, blk_v): grid over block tiles, loop over the heads of the group.
No [B, H, N*Bs, T] score, probability or mask array is ever written to HBM.

Variants: as in the inference kernel ("tpu": Mosaic with
`pltpu.PrefetchScalarGridSpec`, VMEM scratch accumulators, the reduction axes
"arbitrary"; "gpu": Pallas Triton with in-kernel `lax.fori_loop`s whose trip
counts come from the block map). Both variants implement all four kernels;
both run in interpret mode on CPU. See `block_attention`'s docstring for the
choice of Triton over Mosaic GPU and for `BlockSizes`.

Limits
------
- Anchors are clipped to [0, T]. Anchors need not be sorted, but sorted
  anchors (as `sample_anchors` draws them) make the tiles' largest and
  smallest anchors close, so less work is masked.
- The TPU variant keeps per-row statistics (log-sum-exp, delta)
  lane-replicated, [B, H, N*Bs, 128] float32 each: 0.5 KiB per query row and
  head, versus the [N*Bs, T + N*Bs] float32 probabilities XLA would keep.
- The block maps live in SMEM on TPU: B * (N + 2 * nq + nk * (nq + 1)) int32.
- GPU: the block size is padded to a power of two inside each block (padding
  rows/keys are masked), the head dim to a power of two >= 16.
- Gradients w.r.t. anchors are not defined (integer input).
- Residuals kept for the backward: the (padded) inputs, the output and the
  log-sum-exp, no [N*Bs, T] arrays.
- Same checking status as the inference kernel: interpret mode and
  `jax.export` lowering (forward and backward, "tpu" and "cuda"); not yet
  compiled or timed on an accelerator. No sharding rule: call it inside
  `shard_map` on a multi-device mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.block_attention import (
    DOT_NN, DOT_NT, DOT_TN, LANES, BlockSizes, cdiv, dot, key_range_mask, masked_attention_reference, next_pow2,
    online_step, own_block_mask, pad_axis, pick_tile, resolve_block_sizes, round_up, sublane_align)
from pallas_kernels.common import choose_kernel

# --------------------------------------------------------------------------- reference


def train_mask(anchors: jax.Array, *, seq_len: int, block_size: int) -> jax.Array:
    """bool [B, N*Bs, seq_len + N*Bs] over (context keys ; block keys)."""
    b, n = anchors.shape
    ctx = jnp.repeat(jnp.arange(seq_len)[None, None, :] < anchors[..., None], block_size, axis=1)
    blk = jnp.arange(n * block_size) // block_size
    own = jnp.broadcast_to(blk[:, None] == blk[None, :], (b, n * block_size, n * block_size))
    return jnp.concatenate([ctx, own], axis=-1)


def block_attention_train_reference(q, ctx_k, ctx_v, blk_k, blk_v, anchors, *, block_size: int):
    """Plain-jnp `block_attention_train` with the explicit mask (its jax.grad is the reference)."""
    _check(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size)
    mask = train_mask(anchors.astype(jnp.int32), seq_len=ctx_k.shape[2], block_size=block_size)
    return masked_attention_reference(q, (ctx_k, blk_k), (ctx_v, blk_v), mask)


def _check(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size):
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, H, N*Bs, Dh], got shape {q.shape}")
    b, h, r, d = q.shape
    if anchors.ndim != 2 or anchors.shape[0] != b or not jnp.issubdtype(anchors.dtype, jnp.integer):
        raise ValueError(f"anchors must be an int array [B, N] with B={b}, "
                         f"got {anchors.dtype}{list(anchors.shape)}")
    if r != anchors.shape[1] * block_size:
        raise ValueError(f"q has {r} query rows; expected N*block_size = "
                         f"{anchors.shape[1]}*{block_size} = {anchors.shape[1] * block_size}")
    if ctx_k.ndim != 4 or ctx_k.shape != ctx_v.shape or ctx_k.shape[0] != b or ctx_k.shape[3] != d:
        raise ValueError(f"ctx_k/ctx_v must both be [B, Hkv, T, Dh] matching q {q.shape}, "
                         f"got {ctx_k.shape} and {ctx_v.shape}")
    hkv = ctx_k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    if blk_k.shape != (b, hkv, r, d) or blk_v.shape != blk_k.shape:
        raise ValueError(f"blk_k/blk_v must be [B, Hkv, N*Bs, Dh] = {(b, hkv, r, d)}, "
                         f"got {blk_k.shape} and {blk_v.shape}")


# --------------------------------------------------------------------------- geometry


@dataclasses.dataclass(frozen=True)
class _Geo:
    """Static layout of one call: padded sizes and tiles (tiles in rows / keys)."""

    variant: str
    interpret: bool
    sizes: BlockSizes
    group: int  # query heads per kv head
    n: int  # blocks
    n_pad: int
    bs: int  # block size
    bs_p: int  # padded block size (GPU: power of two)
    t: int  # context length
    t_pad: int
    d: int
    d_p: int
    nb: int  # blocks per forward / dq query tile
    nb_b: int  # blocks per backward query tile (divides nb)
    bkv: int
    bkv_b: int  # backward context tile (divides bkv)
    kv_dtypes: tuple[str, ...] = ()  # dtypes of ctx_k, ctx_v, blk_k, blk_v (their gradients')

    @property
    def rows(self):
        return self.n_pad * self.bs_p

    @property
    def bq(self):
        return self.nb * self.bs_p

    @property
    def bq_b(self):
        return self.nb_b * self.bs_p

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.d)


def _geometry(variant, interpret, sizes, q, ctx_k, block_size):
    h, r, d = q.shape[1], q.shape[2], q.shape[3]
    n, t = r // block_size, ctx_k.shape[2]
    align = sublane_align(q.dtype)
    if variant == "gpu":
        bs_p = next_pow2(block_size)
        floor_nb = max(1, 16 // bs_p)

        def blocks(pref):
            nb = 1 << max(0, (max(1, pref // bs_p)).bit_length() - 1)  # largest power of two <= pref/bs_p
            return max(min(nb, next_pow2(n)), floor_nb)

        nb = blocks(sizes.block_q)
        nb_b = min(nb, blocks(sizes.q_bwd))
        bkv, t_pad = pick_tile(t, sizes.block_kv, variant, align)
        bkv_b = min(bkv, sizes.kv_bwd)
        d_p = next_pow2(max(d, 16))
    else:
        bs_p, d_p = block_size, d

        def aligned(nb, limit):
            while (nb * bs_p) % align and nb < limit:
                nb += 1
            return nb

        nb = aligned(min(max(1, sizes.block_q // bs_p), n), n)
        cands = [k for k in range(1, nb + 1) if nb % k == 0 and k * bs_p <= max(sizes.q_bwd, bs_p)
                 and (k * bs_p % align == 0 or k == nb)]
        nb_b = max(cands) if cands else nb
        bkv, t_pad = pick_tile(t, sizes.block_kv, variant, align)
        kv_cands = [k for k in range(align, bkv + 1, align) if bkv % k == 0 and k <= sizes.kv_bwd]
        bkv_b = max(kv_cands) if kv_cands else bkv
    return _Geo(variant, interpret, sizes, h // ctx_k.shape[1], n, round_up(n, nb), block_size, bs_p,
                t, t_pad, d, d_p, nb, nb_b, bkv, bkv_b)


def _pad_rows(x, geo):
    """[B, heads, N*Bs, D] -> [B, heads, n_pad*bs_p, d_p] (padding each block and the block count)."""
    b, h = x.shape[:2]
    x = x.reshape(b, h, geo.n, geo.bs, x.shape[-1])
    x = pad_axis(pad_axis(pad_axis(x, 2, geo.n_pad), 3, geo.bs_p), 4, geo.d_p)
    return x.reshape(b, h, geo.rows, geo.d_p)


def _unpad_rows(x, geo):
    b, h = x.shape[:2]
    x = x.reshape(b, h, geo.n_pad, geo.bs_p, geo.d_p)[:, :, :geo.n, :geo.bs, :geo.d]
    return x.reshape(b, h, geo.n * geo.bs, geo.d)


def _block_map(anchors_p, nb, bkv):
    """Per query tile: context tiles to visit, and how many of them need no mask."""
    a = anchors_p.reshape(anchors_p.shape[0], -1, nb)
    return cdiv(jnp.max(a, -1), bkv).astype(jnp.int32), lax.div(jnp.min(a, -1), bkv).astype(jnp.int32)


def _visit_lists(counts, nk):
    """Per context tile: the query tiles that visit it (first `qcount`, then the last one repeated)."""
    nq = counts.shape[1]
    visit = counts[:, None, :] > jnp.arange(nk, dtype=jnp.int32)[None, :, None]  # [B, nk, nq]
    qcount = jnp.sum(visit, -1).astype(jnp.int32)
    order = jnp.argsort(~visit, axis=-1, stable=True).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(qcount - 1, 0)[..., None], -1)
    return jnp.where(jnp.arange(nq)[None, None] < qcount[..., None], order, last), qcount


# --------------------------------------------------------------------------- tile math (both variants)


def _probs(q, k, lse, mask, scale):
    s = dot(q, k, DOT_NT) * scale
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return jnp.exp(s - lse)


def _dq_tile(q, k, v, do, lse, delta, mask, scale):
    p = _probs(q, k, lse, mask, scale)
    ds = p * (dot(do, v, DOT_NT) - delta)
    return dot(ds.astype(k.dtype), k, DOT_NN)


def _dkv_tile(q, k, v, do, lse, delta, mask, scale):
    p = _probs(q, k, lse, mask, scale)
    dv = dot(p.astype(do.dtype), do, DOT_TN)
    ds = p * (dot(do, v, DOT_NT) - delta)
    return dot(ds.astype(q.dtype), q, DOT_TN), dv


def _tpu_row_limits(anchors_ref, first, nb, bs_p, shape):
    """int [rows, cols]: each row's anchor; the tile's blocks are anchors_ref[first : first + nb].

    (The scalar-prefetch arrays are passed flattened to 1-D, so their SMEM
    footprint is their size whatever SMEM's tiling of 2-D arrays.)"""
    r = lax.broadcasted_iota(jnp.int32, shape, 0)
    lim = jnp.full(shape, anchors_ref[first], jnp.int32)
    for k in range(1, nb):
        lim = jnp.where(r >= k * bs_p, anchors_ref[first + k], lim)
    return lim


# --------------------------------------------------------------------------- TPU kernels


def _tpu_params(*semantics):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics)


def _tpu_fwd_kernel(counts_ref, full_ref, anchors_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, lse_ref,
                    m_sc, l_sc, acc_sc, *, geo):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tile = b * pl.num_programs(2) + i
    count, full, bq, bkv = counts_ref[tile], full_ref[tile], geo.bq, geo.bkv

    def store(state):
        m_sc[...] = jnp.broadcast_to(state[0], m_sc.shape)
        l_sc[...] = jnp.broadcast_to(state[1], l_sc.shape)
        acc_sc[...] = state[2]

    @pl.when(j == 0)
    def _own():
        own = own_block_mask(bq, geo.nb, geo.bs, geo.bs_p)
        store(online_step(q_ref[...], kb_ref[...], vb_ref[...], own, None, geo.scale))

    def context(masked):
        mask = None
        if masked:
            lim = _tpu_row_limits(anchors_ref, b * geo.n_pad + i * geo.nb, geo.nb, geo.bs_p, (bq, bkv))
            mask = key_range_mask(bq, bkv, j * bkv, lim)
        state = (m_sc[:, :1], l_sc[:, :1], acc_sc[...])
        store(online_step(q_ref[...], kc_ref[...], vc_ref[...], mask, state, geo.scale))

    pl.when(j < full)(functools.partial(context, False))
    pl.when((j >= full) & (j < count))(functools.partial(context, True))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = (acc_sc[...] / l_sc[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])


def _tpu_forward(q, kb, vb, kc, vc, anchors_p, geo):
    from jax.experimental.pallas import tpu as pltpu

    b, h, rows, d = q.shape
    g, bq, bkv = geo.group, geo.bq, geo.bkv
    nq = rows // bq
    counts, full = _block_map(anchors_p, geo.nb, bkv)
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    blk_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j, *_: (bi, lax.div(hi, g), i, 0))
    ctx_spec = pl.BlockSpec((None, None, bkv, d), lambda bi, hi, i, j, c, *_: (
        bi, lax.div(hi, g), jnp.minimum(j, jnp.maximum(c[bi * nq + i] - 1, 0)), 0))
    lse_spec = pl.BlockSpec((None, None, bq, LANES), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    return pl.pallas_call(
        functools.partial(_tpu_fwd_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, h, rows, LANES), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(b, h, rows // bq, geo.t_pad // bkv),
            in_specs=[q_spec, blk_spec, blk_spec, ctx_spec, ctx_spec], out_specs=(q_spec, lse_spec),
            scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                            pltpu.VMEM((bq, d), jnp.float32)]),
        compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=geo.interpret, name="block_attention_train_fwd_tpu",
    )(counts.reshape(-1), full.reshape(-1), anchors_p.reshape(-1), q, kb, vb, kc, vc)


def _tpu_dq_kernel(counts_ref, full_ref, anchors_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, do_ref, lse_ref,
                   delta_ref, dq_ref, acc_sc, *, geo):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tile = b * pl.num_programs(2) + i
    count, full, bq, bkv = counts_ref[tile], full_ref[tile], geo.bq_b, geo.bkv_b

    def tile(k, v, mask):
        return _dq_tile(q_ref[...], k, v, do_ref[...], lse_ref[:, :1], delta_ref[:, :1], mask, geo.scale)

    @pl.when(j == 0)
    def _own():
        acc_sc[...] = tile(kb_ref[...], vb_ref[...], own_block_mask(bq, geo.nb_b, geo.bs, geo.bs_p))

    def context(masked):
        mask = None
        if masked:
            lim = _tpu_row_limits(anchors_ref, b * geo.n_pad + i * geo.nb_b, geo.nb_b, geo.bs_p, (bq, bkv))
            mask = key_range_mask(bq, bkv, j * bkv, lim)
        acc_sc[...] += tile(kc_ref[...], vc_ref[...], mask)

    pl.when(j < full)(functools.partial(context, False))
    pl.when((j >= full) & (j < count))(functools.partial(context, True))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (acc_sc[...] * geo.scale).astype(dq_ref.dtype)


def _tpu_dq(q, kb, vb, kc, vc, do, lse, delta, anchors_p, geo):
    from jax.experimental.pallas import tpu as pltpu

    b, h, rows, d = q.shape
    g, bq, bkv = geo.group, geo.bq_b, geo.bkv_b
    nq = rows // bq
    counts, full = _block_map(anchors_p, geo.nb_b, bkv)
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    blk_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j, *_: (bi, lax.div(hi, g), i, 0))
    ctx_spec = pl.BlockSpec((None, None, bkv, d), lambda bi, hi, i, j, c, *_: (
        bi, lax.div(hi, g), jnp.minimum(j, jnp.maximum(c[bi * nq + i] - 1, 0)), 0))
    row_spec = pl.BlockSpec((None, None, bq, LANES), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    return pl.pallas_call(
        functools.partial(_tpu_dq_kernel, geo=geo),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(b, h, rows // bq, geo.t_pad // bkv),
            in_specs=[q_spec, blk_spec, blk_spec, ctx_spec, ctx_spec, q_spec, row_spec, row_spec],
            out_specs=q_spec, scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
        compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=geo.interpret, name="block_attention_train_dq_tpu",
    )(counts.reshape(-1), full.reshape(-1), anchors_p.reshape(-1), q, kb, vb, kc, vc, do, lse, delta)


def _tpu_dkv_ctx_kernel(qlist_ref, qcount_ref, full_ref, anchors_ref, q_ref, kc_ref, vc_ref, do_ref, lse_ref,
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
        mask = None
        if masked:
            lim = _tpu_row_limits(anchors_ref, b * geo.n_pad + i * geo.nb_b, geo.nb_b, geo.bs_p, (bq, bkv))
            mask = key_range_mask(bq, bkv, j * bkv, lim)
        dk, dv = _dkv_tile(q_ref[...], kc_ref[...], vc_ref[...], do_ref[...], lse_ref[:, :1],
                           delta_ref[:, :1], mask, geo.scale)
        dk_sc[...] += dk
        dv_sc[...] += dv

    pl.when(visits & unmasked)(functools.partial(step, False))
    pl.when(visits & ~unmasked)(functools.partial(step, True))

    @pl.when((gi == pl.num_programs(3) - 1) & (t == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = (dk_sc[...] * geo.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tpu_dkv_ctx(q, kc, vc, do, lse, delta, anchors_p, geo):
    from jax.experimental.pallas import tpu as pltpu

    b, _, rows, d = q.shape
    g, bq, bkv = geo.group, geo.bq_b, geo.bkv_b
    hkv, nk, nq = kc.shape[1], geo.t_pad // bkv, rows // bq
    counts, full = _block_map(anchors_p, geo.nb_b, bkv)
    qlist, qcount = _visit_lists(counts, nk)

    def q_map(bi, kh, j, gi, t, ql, *_):
        return bi, kh * g + gi, ql[(bi * nk + j) * nq + t], 0

    q_spec = pl.BlockSpec((None, None, bq, d), q_map)
    row_spec = pl.BlockSpec((None, None, bq, LANES), q_map)
    kv_spec = pl.BlockSpec((None, None, bkv, d), lambda bi, kh, j, gi, t, *_: (bi, kh, j, 0))
    return pl.pallas_call(
        functools.partial(_tpu_dkv_ctx_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(b, hkv, nk, g, nq),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec], out_specs=(kv_spec, kv_spec),
            scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)]),
        compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=geo.interpret, name="block_attention_train_dkv_ctx_tpu",
    )(qlist.reshape(-1), qcount.reshape(-1), full.reshape(-1), anchors_p.reshape(-1), q, kc, vc, do, lse,
      delta)


def _tpu_dkv_blk_kernel(q_ref, kb_ref, vb_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc, *,
                        geo):
    gi = pl.program_id(3)

    @pl.when(gi == 0)
    def _zero():
        dk_sc[...] = jnp.zeros_like(dk_sc)
        dv_sc[...] = jnp.zeros_like(dv_sc)

    own = own_block_mask(geo.bq_b, geo.nb_b, geo.bs, geo.bs_p)
    dk, dv = _dkv_tile(q_ref[...], kb_ref[...], vb_ref[...], do_ref[...], lse_ref[:, :1], delta_ref[:, :1],
                       own, geo.scale)
    dk_sc[...] += dk
    dv_sc[...] += dv

    @pl.when(gi == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_sc[...] * geo.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tpu_dkv_blk(q, kb, vb, do, lse, delta, geo):
    from jax.experimental.pallas import tpu as pltpu

    b, _, rows, d = q.shape
    g, bq = geo.group, geo.bq_b
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, kh, i, gi: (bi, kh * g + gi, i, 0))
    row_spec = pl.BlockSpec((None, None, bq, LANES), lambda bi, kh, i, gi: (bi, kh * g + gi, i, 0))
    kv_spec = pl.BlockSpec((None, None, bq, d), lambda bi, kh, i, gi: (bi, kh, i, 0))
    return pl.pallas_call(
        functools.partial(_tpu_dkv_blk_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(kb.shape, kb.dtype), jax.ShapeDtypeStruct(vb.shape, vb.dtype)),
        grid=(b, kb.shape[1], rows // bq, g),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec], out_specs=(kv_spec, kv_spec),
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32), pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=geo.interpret, name="block_attention_train_dkv_blk_tpu",
    )(q, kb, vb, do, lse, delta)


# --------------------------------------------------------------------------- GPU (Triton) kernels


def _triton_params(geo):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=geo.sizes.warps(geo.d_p), num_stages=geo.sizes.num_stages)


def _gpu_fwd_kernel(count_ref, full_ref, lim_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, lse_ref, *, geo):
    q, bq, bkv = q_ref[...], geo.bq, geo.bkv
    lim = lim_ref[...][:, None]
    own = own_block_mask(bq, geo.nb, geo.bs, geo.bs_p)
    state = online_step(q, kb_ref[...], vb_ref[...], own, None, geo.scale)

    def body(t, st, masked):
        start = pl.multiple_of(t * bkv, bkv)
        mask = key_range_mask(bq, bkv, start, lim) if masked else None
        return online_step(q, kc_ref[pl.ds(start, bkv), :], vc_ref[pl.ds(start, bkv), :], mask, st, geo.scale)

    full = full_ref[...]
    state = lax.fori_loop(0, full, functools.partial(body, masked=False), state)
    m, lsum, acc = lax.fori_loop(full, count_ref[...], functools.partial(body, masked=True), state)
    o_ref[...] = (acc / lsum).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log(lsum))[:, 0]


def _gpu_forward(q, kb, vb, kc, vc, anchors_p, lim, geo):
    b, h, rows, d = q.shape
    g, bq = geo.group, geo.bq
    counts, full = _block_map(anchors_p, geo.nb, geo.bkv)
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, hi, i, 0))
    scalar = pl.BlockSpec((None, None), lambda bi, hi, i: (bi, i))
    return pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, rows), jnp.float32)),
        grid=(b, h, rows // bq),
        in_specs=[scalar, scalar, pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i)), q_spec,
                  pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, lax.div(hi, g), i, 0)),
                  pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, lax.div(hi, g), i, 0)),
                  pl.BlockSpec((None, None, geo.t_pad, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0)),
                  pl.BlockSpec((None, None, geo.t_pad, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0))],
        out_specs=(q_spec, pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i))),
        compiler_params=_triton_params(geo), interpret=geo.interpret, name="block_attention_train_fwd_gpu",
    )(counts, full, lim, q, kb, vb, kc, vc)


def _gpu_dq_kernel(count_ref, full_ref, lim_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, do_ref, lse_ref,
                   delta_ref, dq_ref, *, geo):
    q, do, bq, bkv = q_ref[...], do_ref[...], geo.bq_b, geo.bkv_b
    lse, delta, lim = lse_ref[...][:, None], delta_ref[...][:, None], lim_ref[...][:, None]
    own = own_block_mask(bq, geo.nb_b, geo.bs, geo.bs_p)
    acc = _dq_tile(q, kb_ref[...], vb_ref[...], do, lse, delta, own, geo.scale)

    def body(t, acc, masked):
        start = pl.multiple_of(t * bkv, bkv)
        mask = key_range_mask(bq, bkv, start, lim) if masked else None
        k, v = kc_ref[pl.ds(start, bkv), :], vc_ref[pl.ds(start, bkv), :]
        return acc + _dq_tile(q, k, v, do, lse, delta, mask, geo.scale)

    full = full_ref[...]
    acc = lax.fori_loop(0, full, functools.partial(body, masked=False), acc)
    acc = lax.fori_loop(full, count_ref[...], functools.partial(body, masked=True), acc)
    dq_ref[...] = (acc * geo.scale).astype(dq_ref.dtype)


def _gpu_dq(q, kb, vb, kc, vc, do, lse, delta, anchors_p, lim, geo):
    b, h, rows, d = q.shape
    g, bq = geo.group, geo.bq_b
    counts, full = _block_map(anchors_p, geo.nb_b, geo.bkv_b)
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, hi, i, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i))
    scalar = pl.BlockSpec((None, None), lambda bi, hi, i: (bi, i))
    blk_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, lax.div(hi, g), i, 0))
    ctx_spec = pl.BlockSpec((None, None, geo.t_pad, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0))
    return pl.pallas_call(
        functools.partial(_gpu_dq_kernel, geo=geo),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b, h, rows // bq),
        in_specs=[scalar, scalar, pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i)), q_spec, blk_spec,
                  blk_spec, ctx_spec, ctx_spec, q_spec, row_spec, row_spec],
        out_specs=q_spec,
        compiler_params=_triton_params(geo), interpret=geo.interpret, name="block_attention_train_dq_gpu",
    )(counts, full, lim, q, kb, vb, kc, vc, do, lse, delta)


def _gpu_dkv_ctx_kernel(qlist_ref, qcount_ref, lim_ref, q_ref, kc_ref, vc_ref, do_ref, lse_ref, delta_ref,
                        dk_ref, dv_ref, *, geo):
    j = pl.program_id(2)
    k, v, bq, bkv = kc_ref[...], vc_ref[...], geo.bq_b, geo.bkv_b
    zeros = jnp.zeros(k.shape, jnp.float32)

    def per_tile(t, carry, gi):
        start = pl.multiple_of(qlist_ref[t] * bq, bq)
        rows = pl.ds(start, bq)
        mask = key_range_mask(bq, bkv, j * bkv, lim_ref[rows][:, None])
        dk, dv = _dkv_tile(q_ref[gi, rows, :], k, v, do_ref[gi, rows, :], lse_ref[gi, rows][:, None],
                           delta_ref[gi, rows][:, None], mask, geo.scale)
        return carry[0] + dk, carry[1] + dv

    def per_head(gi, carry):
        return lax.fori_loop(0, qcount_ref[...], functools.partial(per_tile, gi=gi), carry)

    dk, dv = lax.fori_loop(0, geo.group, per_head, (zeros, zeros))
    dk_ref[...] = (dk * geo.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _gpu_dkv_ctx(q, kc, vc, do, lse, delta, anchors_p, lim, geo):
    b, _, rows, d = q.shape
    g, bkv = geo.group, geo.bkv_b
    hkv, nk, nq = kc.shape[1], geo.t_pad // bkv, rows // geo.bq_b
    counts, _ = _block_map(anchors_p, geo.nb_b, bkv)
    qlist, qcount = _visit_lists(counts, nk)
    group_spec = pl.BlockSpec((None, g, rows, d), lambda bi, kh, j: (bi, kh, 0, 0))
    group_rows = pl.BlockSpec((None, g, rows), lambda bi, kh, j: (bi, kh, 0))
    kv_spec = pl.BlockSpec((None, None, bkv, d), lambda bi, kh, j: (bi, kh, j, 0))
    return pl.pallas_call(
        functools.partial(_gpu_dkv_ctx_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype)),
        grid=(b, hkv, nk),
        in_specs=[pl.BlockSpec((None, None, nq), lambda bi, kh, j: (bi, j, 0)),
                  pl.BlockSpec((None, None), lambda bi, kh, j: (bi, j)),
                  pl.BlockSpec((None, rows), lambda bi, kh, j: (bi, 0)),
                  group_spec, kv_spec, kv_spec, group_spec, group_rows, group_rows],
        out_specs=(kv_spec, kv_spec),
        compiler_params=_triton_params(geo), interpret=geo.interpret,
        name="block_attention_train_dkv_ctx_gpu",
    )(qlist, qcount, lim, q, kc, vc, do, lse, delta)


def _gpu_dkv_blk_kernel(q_ref, kb_ref, vb_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, geo):
    k, v = kb_ref[...], vb_ref[...]
    own = own_block_mask(geo.bq_b, geo.nb_b, geo.bs, geo.bs_p)
    zeros = jnp.zeros(k.shape, jnp.float32)

    def per_head(gi, carry):
        dk, dv = _dkv_tile(q_ref[gi], k, v, do_ref[gi], lse_ref[gi][:, None], delta_ref[gi][:, None], own,
                           geo.scale)
        return carry[0] + dk, carry[1] + dv

    dk, dv = lax.fori_loop(0, geo.group, per_head, (zeros, zeros))
    dk_ref[...] = (dk * geo.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _gpu_dkv_blk(q, kb, vb, do, lse, delta, geo):
    b, _, rows, d = q.shape
    g, bq = geo.group, geo.bq_b
    group_spec = pl.BlockSpec((None, g, bq, d), lambda bi, kh, i: (bi, kh, i, 0))
    group_rows = pl.BlockSpec((None, g, bq), lambda bi, kh, i: (bi, kh, i))
    kv_spec = pl.BlockSpec((None, None, bq, d), lambda bi, kh, i: (bi, kh, i, 0))
    return pl.pallas_call(
        functools.partial(_gpu_dkv_blk_kernel, geo=geo),
        out_shape=(jax.ShapeDtypeStruct(kb.shape, kb.dtype), jax.ShapeDtypeStruct(vb.shape, vb.dtype)),
        grid=(b, kb.shape[1], rows // bq),
        in_specs=[group_spec, kv_spec, kv_spec, group_spec, group_rows, group_rows],
        out_specs=(kv_spec, kv_spec),
        compiler_params=_triton_params(geo), interpret=geo.interpret,
        name="block_attention_train_dkv_blk_gpu",
    )(q, kb, vb, do, lse, delta)


# --------------------------------------------------------------------------- custom VJP


def _prepare(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo):
    dt = q.dtype
    qp = _pad_rows(q, geo)
    kb, vb = _pad_rows(blk_k.astype(dt), geo), _pad_rows(blk_v.astype(dt), geo)

    def ctx(x):
        return pad_axis(pad_axis(x.astype(dt), 2, geo.t_pad), 3, geo.d_p)

    anchors_p = pad_axis(jnp.clip(anchors.astype(jnp.int32), 0, geo.t), 1, geo.n_pad)
    return qp, ctx(ctx_k), ctx(ctx_v), kb, vb, anchors_p


def _row_limits(anchors_p, geo):
    """int [B, rows]: each query row's anchor (GPU kernels read it as a vector)."""
    return jnp.repeat(anchors_p, geo.bs_p, axis=1)


def _forward(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo):
    qp, kc, vc, kb, vb, anchors_p = _prepare(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo)
    if geo.variant == "tpu":
        o, lse = _tpu_forward(qp, kb, vb, kc, vc, anchors_p, geo)
    else:
        o, lse = _gpu_forward(qp, kb, vb, kc, vc, anchors_p, _row_limits(anchors_p, geo), geo)
    return _unpad_rows(o, geo), (qp, kc, vc, kb, vb, anchors_p, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _train_kernel(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo):
    return _forward(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo)[0]


def _train_kernel_fwd(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo):
    return _forward(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo)


def _train_kernel_bwd(geo, saved, g):
    qp, kc, vc, kb, vb, anchors_p, o, lse = saved
    dtypes = geo.kv_dtypes
    do = _pad_rows(g.astype(qp.dtype), geo)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, H, rows]
    if geo.variant == "tpu":
        delta = jnp.broadcast_to(delta[..., None], lse.shape)
        dq = _tpu_dq(qp, kb, vb, kc, vc, do, lse, delta, anchors_p, geo)
        dkc, dvc = _tpu_dkv_ctx(qp, kc, vc, do, lse, delta, anchors_p, geo)
        dkb, dvb = _tpu_dkv_blk(qp, kb, vb, do, lse, delta, geo)
    else:
        lim = _row_limits(anchors_p, geo)
        dq = _gpu_dq(qp, kb, vb, kc, vc, do, lse, delta, anchors_p, lim, geo)
        dkc, dvc = _gpu_dkv_ctx(qp, kc, vc, do, lse, delta, anchors_p, lim, geo)
        dkb, dvb = _gpu_dkv_blk(qp, kb, vb, do, lse, delta, geo)

    def ctx(x, dt):
        return x[:, :, :geo.t, :geo.d].astype(dt)

    return (_unpad_rows(dq, geo), ctx(dkc, dtypes[0]), ctx(dvc, dtypes[1]),
            _unpad_rows(dkb, geo).astype(dtypes[2]), _unpad_rows(dvb, geo).astype(dtypes[3]), None)


_train_kernel.defvjp(_train_kernel_fwd, _train_kernel_bwd)


# --------------------------------------------------------------------------- public entry point


def block_attention_train(q, ctx_k, ctx_v, blk_k, blk_v, anchors, *, block_size: int, impl: str = "auto",
                          variant: str | None = None, interpret: bool | None = None,
                          block_sizes: BlockSizes | None = None) -> jax.Array:
    """Many-blocks-per-sequence drafter attention of DFlash training (differentiable).

    q [B, H, N*Bs, Dh]; ctx_k/ctx_v [B, Hkv, T, Dh]; blk_k/blk_v [B, Hkv, N*Bs, Dh];
    anchors int [B, N]: block n's queries see context positions < anchors[b, n]
    and their own block's keys. Returns [B, H, N*Bs, Dh] in q's dtype.
    `impl`/`variant`/`interpret` as in `pallas_kernels.common.choose_kernel`.
    """
    _check(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size)
    choice = choose_kernel(impl, variant, interpret)
    if not choice.use_pallas:
        return block_attention_train_reference(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size=block_size)
    sizes = resolve_block_sizes(block_sizes, choice.variant)
    geo = dataclasses.replace(_geometry(choice.variant, choice.interpret, sizes, q, ctx_k, block_size),
                              kv_dtypes=tuple(jnp.dtype(x.dtype).name for x in (ctx_k, ctx_v, blk_k, blk_v)))
    return _train_kernel(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo)

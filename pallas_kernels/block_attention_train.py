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
Forward: flash-style online softmax (the tile math of
`pallas_kernels.attention_tiles`, shared with the inference kernel). A query
tile holds whole blocks; its own block keys are the same row range of
blk_k/blk_v and are visited first (so no row is ever fully masked); then the
context tiles up to the tile's largest anchor. A scalar-prefetched block map
gives, per (sequence, query tile), the number of context tiles to visit and
the number that are fully visible (no mask needed): fully masked tiles are
neither fetched nor computed, so the cost is Σ over query tiles of the tile's
largest anchor (rounded up to a kv tile), ≈ Bs · Σ_n anchors[b, n] for sorted
anchors, instead of N·Bs·T. The forward saves the log-sum-exp per row.

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
counts come from the block map). Both variants implement all four kernels
(`_block_attention_train_tpu` / `_gpu`, tiles chosen by
`_block_attention_train_layout`); both run in interpret mode on CPU. See
`block_attention`'s docstring for the choice of Triton over Mosaic GPU and
for `BlockSizes`.

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

import jax
import jax.numpy as jnp

from pallas_kernels._block_attention_train_gpu import gpu_dkv_blk, gpu_dkv_ctx, gpu_dq, gpu_forward
from pallas_kernels._block_attention_train_layout import pad_rows, row_limits, train_geometry, unpad_rows
from pallas_kernels._block_attention_train_tpu import tpu_dkv_blk, tpu_dkv_ctx, tpu_dq, tpu_forward
from pallas_kernels.block_attention import BlockSizes, masked_attention_reference, resolve_block_sizes
from pallas_kernels.common import choose_kernel
from pallas_kernels.tiling import pad_axis

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


# --------------------------------------------------------------------------- custom VJP


def _prepare(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo):
    """Casts to q's dtype and pads to the geometry; anchors clipped to [0, T]."""
    dt = q.dtype
    qp = pad_rows(q, geo)
    kb, vb = pad_rows(blk_k.astype(dt), geo), pad_rows(blk_v.astype(dt), geo)

    def ctx(x):
        return pad_axis(pad_axis(x.astype(dt), 2, geo.t_pad), 3, geo.d_p)

    anchors_p = pad_axis(jnp.clip(anchors.astype(jnp.int32), 0, geo.t), 1, geo.n_pad)
    return qp, ctx(ctx_k), ctx(ctx_v), kb, vb, anchors_p


def _forward(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo):
    qp, kc, vc, kb, vb, anchors_p = _prepare(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo)
    if geo.variant == "tpu":
        o, lse = tpu_forward(qp, kb, vb, kc, vc, anchors_p, geo)
    else:
        o, lse = gpu_forward(qp, kb, vb, kc, vc, anchors_p, row_limits(anchors_p, geo), geo)
    return unpad_rows(o, geo), (qp, kc, vc, kb, vb, anchors_p, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _train_kernel(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo):
    return _forward(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo)[0]


def _train_kernel_fwd(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo):
    return _forward(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo)


def _train_kernel_bwd(geo, saved, g):
    qp, kc, vc, kb, vb, anchors_p, o, lse = saved
    dtypes = geo.kv_dtypes
    do = pad_rows(g.astype(qp.dtype), geo)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, H, rows]
    if geo.variant == "tpu":
        delta = jnp.broadcast_to(delta[..., None], lse.shape)
        dq = tpu_dq(qp, kb, vb, kc, vc, do, lse, delta, anchors_p, geo)
        dkc, dvc = tpu_dkv_ctx(qp, kc, vc, do, lse, delta, anchors_p, geo)
        dkb, dvb = tpu_dkv_blk(qp, kb, vb, do, lse, delta, geo)
    else:
        lim = row_limits(anchors_p, geo)
        dq = gpu_dq(qp, kb, vb, kc, vc, do, lse, delta, anchors_p, lim, geo)
        dkc, dvc = gpu_dkv_ctx(qp, kc, vc, do, lse, delta, anchors_p, lim, geo)
        dkb, dvb = gpu_dkv_blk(qp, kb, vb, do, lse, delta, geo)

    def ctx(x, dt):
        return x[:, :, :geo.t, :geo.d].astype(dt)

    return (unpad_rows(dq, geo), ctx(dkc, dtypes[0]), ctx(dvc, dtypes[1]),
            unpad_rows(dkb, geo).astype(dtypes[2]), unpad_rows(dvb, geo).astype(dtypes[3]), None)


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
    geo = dataclasses.replace(train_geometry(choice.variant, choice.interpret, sizes, q, ctx_k, block_size),
                              kv_dtypes=tuple(jnp.dtype(x.dtype).name for x in (ctx_k, ctx_v, blk_k, blk_v)))
    return _train_kernel(q, ctx_k, ctx_v, blk_k, blk_v, anchors, geo)

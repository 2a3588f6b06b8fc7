"""Block-sparse drafter attention for DFlash training: forward and backward Pallas kernels.

The queries of block n see the context before anchors[b, n] and their own
block; differentiable through `jax.custom_vjp`. Design: pallas_kernels/README.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels._block_attention_train_gpu import gpu_dkv_blk, gpu_dkv_ctx, gpu_dq, gpu_forward
from pallas_kernels._block_attention_train_layout import pad_rows, row_limits, train_geometry, unpad_rows
from pallas_kernels._block_attention_train_tpu import tpu_dkv_blk, tpu_dkv_ctx, tpu_dq, tpu_forward
from pallas_kernels._block_attention_types import BlockSizes, resolve_block_sizes
from pallas_kernels.block_attention import masked_attention_reference
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

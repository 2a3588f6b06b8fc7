"""Block-diffusion drafter attention as a Pallas kernel, with its plain-jnp reference.

Each block query attends to its row's live drafter context and to its whole
block (non-causal). Design, grids and costs: pallas_kernels/README.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels._block_attention_kernels import gpu_block_attention, tpu_block_attention
from pallas_kernels._block_attention_types import BlockSizes, resolve_block_sizes
from pallas_kernels.common import TRITON_EXPORT_CHECKS, choose_kernel
from pallas_kernels.tiling import next_pow2, pad_axis, pick_tile, sublane_align

__all__ = ["TRITON_EXPORT_CHECKS", "BlockSizes", "block_attention", "block_attention_reference"]


# --------------------------------------------------------------------------- reference


def masked_attention_reference(q, ks, vs, mask):
    """Grouped-query attention over key chunks with one float32 softmax (plain jnp).

    q [B, H, T, D]; ks/vs: tuples of [B, Hkv, S_i, D]; mask bool [B, T, ΣS_i].
    Fully masked rows give zeros. Returns [B, H, T, D] in q's dtype.
    """
    b, h, t, d = q.shape
    hkv = ks[0].shape[1]
    qg = q.reshape(b, hkv, h // hkv, t, d)
    s = jnp.concatenate([jnp.einsum("bkgtd,bksd->bkgts", qg, k.astype(q.dtype),
                                    preferred_element_type=jnp.float32) for k in ks], -1)
    s = jnp.where(mask[:, None, None], s * (1.0 / math.sqrt(d)), -jnp.inf)
    peak = jnp.max(s, axis=-1, keepdims=True)
    w = jnp.exp(s - jnp.where(jnp.isfinite(peak), peak, 0.0))
    denom = jnp.sum(w, axis=-1, keepdims=True)
    p = w / jnp.where(denom > 0, denom, 1.0)
    v = jnp.concatenate([x.astype(q.dtype) for x in vs], axis=2)
    out = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, h, t, d).astype(q.dtype)


def block_attention_reference(q, ctx_k, ctx_v, ctx_lengths, blk_k, blk_v):
    """Plain-jnp `block_attention`: builds the (context ; block) mask explicitly."""
    _check_inference(q, ctx_k, ctx_v, ctx_lengths, blk_k, blk_v)
    b, _, bs, _ = q.shape
    s = ctx_k.shape[2]
    ctx = jnp.arange(s)[None, None, :] < ctx_lengths.astype(jnp.int32)[:, None, None]
    mask = jnp.concatenate([jnp.broadcast_to(ctx, (b, bs, s)), jnp.ones((b, bs, bs), bool)], -1)
    return masked_attention_reference(q, (ctx_k, blk_k), (ctx_v, blk_v), mask)


def _check_inference(q, ctx_k, ctx_v, ctx_lengths, blk_k, blk_v):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, H, Bs, Dh], got shape {q.shape}")
    b, h, bs, d = q.shape
    if ctx_k.ndim != 4 or ctx_k.shape != ctx_v.shape:
        raise ValueError(f"ctx_k/ctx_v must both be [B, Hkv, S, Dh], got {ctx_k.shape} and {ctx_v.shape}")
    hkv = ctx_k.shape[1]
    if ctx_k.shape[0] != b or ctx_k.shape[3] != d:
        raise ValueError(f"ctx_k {ctx_k.shape} does not match q {q.shape} (batch, head dim)")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    if blk_k.shape != (b, hkv, bs, d) or blk_v.shape != blk_k.shape:
        raise ValueError(f"blk_k/blk_v must be [B, Hkv, Bs, Dh] = {(b, hkv, bs, d)}, "
                         f"got {blk_k.shape} and {blk_v.shape}")
    if ctx_lengths.shape != (b,) or not jnp.issubdtype(ctx_lengths.dtype, jnp.integer):
        raise ValueError(f"ctx_lengths must be an int array [B] = [{b}], "
                         f"got {ctx_lengths.dtype}{list(ctx_lengths.shape)}")


# --------------------------------------------------------------------------- public entry point


def block_attention(q, ctx_k, ctx_v, ctx_lengths, blk_k, blk_v, *, impl: str = "auto",
                    variant: str | None = None, interpret: bool | None = None,
                    block_sizes: BlockSizes | None = None) -> jax.Array:
    """Attention of one draft block per row over (live context ; the block itself).

    q [B, H, Bs, Dh]; ctx_k/ctx_v [B, Hkv, S, Dh] with row b's valid slots
    < ctx_lengths[b] (int [B]); blk_k/blk_v [B, Hkv, Bs, Dh], all visible.
    Returns [B, H, Bs, Dh] in q's dtype. `impl`/`variant`/`interpret` as in
    `pallas_kernels.common.choose_kernel`; `block_sizes` defaults per variant.
    """
    _check_inference(q, ctx_k, ctx_v, ctx_lengths, blk_k, blk_v)
    choice = choose_kernel(impl, variant, interpret)
    if not choice.use_pallas:
        return block_attention_reference(q, ctx_k, ctx_v, ctx_lengths, blk_k, blk_v)
    var = choice.variant
    sizes = resolve_block_sizes(block_sizes, var)
    b, h, bs, d = q.shape
    hkv, s = ctx_k.shape[1], ctx_k.shape[2]
    rows = (h // hkv) * bs
    dt = q.dtype
    align = sublane_align(dt)
    bq, rows_p = pick_tile(rows, sizes.block_q, var, align)
    bkv, s_p = pick_tile(s, sizes.block_kv, var, align)
    d_p = next_pow2(max(d, 16)) if var == "gpu" else d
    bs_p = next_pow2(max(bs, 16)) if var == "gpu" else bs

    def prep(x, axis_len):
        return pad_axis(pad_axis(x.astype(dt), 2, axis_len), 3, d_p)

    qg = prep(q.reshape(b, hkv, rows, d), rows_p)
    kb, vb = prep(blk_k, bs_p), prep(blk_v, bs_p)
    kc, vc = prep(ctx_k, s_p), prep(ctx_v, s_p)
    lens = jnp.clip(ctx_lengths.astype(jnp.int32), 0, s)
    scale = 1.0 / math.sqrt(d)
    if var == "tpu":
        out = tpu_block_attention(qg, kb, vb, kc, vc, lens, bq=bq, bkv=bkv, scale=scale,
                                  interpret=choice.interpret)
    else:
        out = gpu_block_attention(qg, kb, vb, kc, vc, lens, bq=bq, bkv=bkv, bs=bs, scale=scale,
                                  interpret=choice.interpret, sizes=sizes)
    return out[:, :, :rows, :d].reshape(b, h, bs, d)

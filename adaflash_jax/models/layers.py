"""Building blocks shared by the target LM and the drafter.

Pure functions over arrays (the modules own the parameters): RMSNorm, rotary
embeddings (with Llama-3 frequency scaling), the SwiGLU MLP and the single
attention entry point that every model calls, so faster kernels slot in
behind `impl=` without touching the models.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from adaflash_jax.models.config import RopeScaling
from adaflash_jax.parallel.kernel_sharding import per_shard
from pallas_kernels.block_attention import block_attention
from pallas_kernels.block_attention_train import block_attention_train
from pallas_kernels.common import choose_kernel
from pallas_kernels.tree_attention import tree_attention as tree_attention_kernel
from pallas_kernels.verify_attention import verify_attention

# "pallas" / "auto" route the structured attentions (the drafter's block attention, packed and tree
# verification) and the fused verify head to `pallas_kernels`; "auto" picks Pallas on TPU/GPU
# only. Attention with a general mask (prefill, AR and fixed-width verify) always runs in XLA.
ATTENTION_IMPLS = ("xla", "pallas", "auto")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back before the weight (as HF does)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * xf.astype(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jnp.ndarray:
    """Inverse rotary frequencies, float32 [head_dim // 2]."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., head_dim] for integer positions [...]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B, heads, T, Dh] with tables [B, T, Dh] (HF's rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    out = xf * cos[:, None] + rotated.astype(jnp.float32) * sin[:, None]
    return out.astype(x.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)) with [in, out] weights."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def finite_or_zero(x: jax.Array) -> jax.Array:
    """x with its NaN / infinite entries set to 0; finite entries are returned bit for bit."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def attention(q: jax.Array, k, v, mask: jax.Array | None, *, impl: str = "xla") -> jax.Array:
    """Grouped-query attention, the one entry point all models use.

    q: [B, H, T, Dh]; k, v: [B, Hkv, S, Dh] (head-major, like the KV cache), or
    tuples of such chunks whose key axes concatenate (e.g. (cached, new)): one
    softmax over all of them, without materialising the concatenated keys.
    mask: bool [B, T, ΣS] (True = may attend) or None. Returns [B, H, T, Dh].
    Softmax runs in float32; fully masked rows give zeros, not NaN.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {ATTENTION_IMPLS}")
    ks, vs = (tuple(k), tuple(v)) if isinstance(k, (tuple, list)) else ((k,), (v,))
    b, h, t, dh = q.shape
    hkv = ks[0].shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    qg = q.reshape(b, hkv, h // hkv, t, dh)
    scores = jnp.concatenate([jnp.einsum("bkgtd,bksd->bkgts", qg, kc, preferred_element_type=jnp.float32)
                              for kc in ks], axis=-1)
    scores = scores * (1.0 / math.sqrt(dh))
    if mask is not None:
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    out, start = 0.0, 0
    for vc in vs:
        part = jax.lax.slice_in_dim(probs, start, start + vc.shape[2], axis=-1)
        out = out + jnp.einsum("bkgts,bksd->bkgtd", part.astype(vc.dtype), vc,
                               preferred_element_type=jnp.float32)
        start += vc.shape[2]
    return out.reshape(b, h, t, dh).astype(q.dtype)


def drafter_attention(q: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array, blk_k: jax.Array,
                      blk_v: jax.Array, mask: jax.Array, *, ctx_lengths: jax.Array | None = None,
                      anchors: jax.Array | None = None, block_size: int | None = None,
                      impl: str = "xla") -> jax.Array:
    """The drafter's attention over (context keys ; block keys), non-causal.

    mask: bool [B, T, S + M] (the XLA form). With impl="pallas", the structure behind
    the mask picks a kernel instead: `ctx_lengths` [B] (drafting: one block sees its
    row's first ctx_lengths context slots) -> `pallas_kernels.block_attention`;
    `anchors` [B, N] (training: block n sees context < anchor n and itself) ->
    `pallas_kernels.block_attention_train` (differentiable). Returns [B, H, T, Dh].
    """
    if choose_kernel(impl).use_pallas:  # per device shard under a mesh (parallel.kernel_sharding)
        ctx_k, ctx_v = ctx_k.astype(q.dtype), ctx_v.astype(q.dtype)
        if ctx_lengths is not None:
            return per_shard(functools.partial(block_attention, impl=impl),
                             (q, ctx_k, ctx_v, ctx_lengths, blk_k, blk_v), (1, 1, 1, None, 1, 1))
        if anchors is not None:
            return per_shard(functools.partial(block_attention_train, block_size=block_size, impl=impl),
                             (q, ctx_k, ctx_v, blk_k, blk_v, anchors), (1, 1, 1, 1, 1, None))
    k = jnp.concatenate([ctx_k.astype(blk_k.dtype), blk_k], axis=2)
    v = jnp.concatenate([ctx_v.astype(blk_v.dtype), blk_v], axis=2)
    return attention(q, k, v, mask, impl="xla")


def tree_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, cache_k: jax.Array,
                   cache_v: jax.Array, cache_lengths: jax.Array, ancestors: jax.Array, *,
                   impl: str = "xla") -> jax.Array:
    """Attention of a verified draft tree, the entry point of tree verification.

    q: [B, H, N, Dh] and k_new/v_new: [B, Hkv, N, Dh] for the N tree nodes of each row;
    cache_k/v: one layer's [B, Hkv, S, Dh]. Node i of row b sees the row's cached slots
    < cache_lengths[b] and the nodes j with ancestors[b, i, j] (its ancestors and itself).
    Returns [B, H, N, Dh]. impl="pallas" runs `pallas_kernels.tree_attention` (no
    [B, H, N, S + N] scores in memory; cache tiles past a row's length are skipped).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {ATTENTION_IMPLS}")
    if choose_kernel(impl).use_pallas:
        return tree_attention_kernel(q, k_new, v_new, cache_k.astype(q.dtype), cache_v.astype(q.dtype),
                                     cache_lengths, ancestors, impl=impl)
    b, n = ancestors.shape[:2]
    cached = jnp.arange(cache_k.shape[2])[None, None] < cache_lengths[:, None, None]
    mask = jnp.concatenate([jnp.broadcast_to(cached, (b, n, cache_k.shape[2])), ancestors], axis=-1)
    return attention(q, (cache_k.astype(q.dtype), k_new), (cache_v.astype(q.dtype), v_new), mask, impl="xla")


def packed_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, cache_k: jax.Array,
                     cache_v: jax.Array, layout, cache_lengths: jax.Array, positions: jax.Array,
                     *, impl: str = "xla") -> jax.Array:
    """Attention for packed variable-length tokens, the entry point of packed verification.

    q: [N, H, Dh] and k_new/v_new: [N, Hkv, Dh] for the slots of `layout` (a
    `models.packed_layout.PackedLayout`); cache_k/v: one layer's [B, Hkv, S, Dh].
    Slot j (row s, position p) sees row s's cached slots < cache_lengths[s] and
    row s's packed tokens at positions <= p. Returns [N, H, Dh]; padding slots
    are zeros. The XLA form unpacks to the padded [B, H, Bs, Dh] layout (Bs =
    layout.block_size) and reuses `attention`; impl="pallas" runs
    `pallas_kernels.verify_attention` on the packed buffer instead (no padded
    scores; each row's cache is read once and tiles past its length are skipped).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {ATTENTION_IMPLS}")
    if choose_kernel(impl).use_pallas:
        return verify_attention(q, k_new, v_new, cache_k.astype(q.dtype), cache_v.astype(q.dtype),
                                layout.seq_ids, layout.offsets, layout.valid, cache_lengths,
                                impl=impl, width=layout.block_size)

    def padded(x):  # [N, heads, Dh] -> [B, heads, Bs, Dh]
        return jnp.swapaxes(layout.unpack(x), 1, 2)

    pos = layout.unpack(positions)  # [B, Bs]; unverified entries are masked out below
    bs = pos.shape[1]
    live = jnp.arange(bs)[None] < layout.lengths[:, None]  # [B, Bs]
    cached = jnp.arange(cache_k.shape[2])[None, None] < cache_lengths[:, None, None]
    new = live[:, None, :] & (pos[:, None, :] <= pos[:, :, None])
    mask = jnp.concatenate([jnp.broadcast_to(cached, (cached.shape[0], bs, cached.shape[2])), new],
                           axis=-1)
    out = attention(padded(q), (cache_k.astype(q.dtype), padded(k_new)),
                    (cache_v.astype(q.dtype), padded(v_new)), mask, impl=impl)
    return layout.pack(jnp.swapaxes(out, 1, 2))

"""Block-diffusion drafter attention as a Pallas kernel, with its plain-jnp reference.

What it computes
----------------
The DFlash drafter drafts a block of `Bs` positions at once. Each block query
attends, with one float32 softmax (scale 1/sqrt(Dh), grouped-query heads), to

- the cached drafter context: row b's slots `< ctx_lengths[b]` of
  ctx_k/ctx_v [B, Hkv, S, Dh], and
- the block's own keys blk_k/blk_v [B, Hkv, Bs, Dh], all visible (non-causal).

`block_attention(q, ctx_k, ctx_v, ctx_lengths, blk_k, blk_v)` returns
[B, H, Bs, Dh] in q's dtype: the same numbers as `models.layers.attention` on
the concatenated keys (context ; block) with the matching mask, without
building the concatenated K/V or the mask. The training form with many blocks
per sequence (block n sees context positions < anchors[b, n] and its own block)
lives in `pallas_kernels.block_attention_train`.

How
---
Flash-style online softmax over KV tiles, in float32. The block's own keys are
the first tile (every query sees at least those, so the running max is finite
from the start and no row is ever fully masked); then the context tiles. Only
the tile holding `ctx_lengths[b]` is masked; tiles past it are skipped. The
query heads of a KV group are folded into the rows of one query tile
(q [B, H, Bs, Dh] is read as [B, Hkv, (H/Hkv)*Bs, Dh], a free reshape), so each
KV tile is read from HBM once per KV head, not once per query head.

Memory traffic saved: the XLA form writes the [B, H, Bs, S+Bs] float32 scores
and the probabilities to HBM and reads them back; here they live in VMEM /
registers only, HBM sees q, the visited K/V tiles and the output. Compute and
K/V reads are proportional to the live context (Σ_b ctx_lengths[b]), not to
the cache size S: tiles past a row's length are neither computed nor fetched
(the TPU grid still steps over them, a fraction of a microsecond each).

Variants (`impl=`/`variant=`/`interpret=`, see `pallas_kernels.common`)
-------------------------------------------------------------------
- "tpu" (Mosaic): `pltpu.PrefetchScalarGridSpec` with the lengths as scalar
  prefetch; grid (batch, kv head, query tile, kv tile), the kv axis
  "arbitrary"; m/l/acc in VMEM scratch (m and l lane-replicated to 128 lanes);
  the context index map clamps to the last live tile, so skipped tiles repeat
  the previous block index and are not fetched again.
- "gpu" (Pallas Triton): grid (batch, kv head, query tile); each program runs
  an in-kernel `lax.fori_loop` over the live context tiles (the trip count is
  read from the lengths, so skipped tiles cost nothing). Triton was chosen over
  Mosaic GPU: both lower from a CPU host with `jax.export`, but Mosaic GPU has
  no `dot_general` lowering (matmuls must be written as explicit Hopper wgmma /
  Blackwell tcgen05 calls on swizzled SMEM operands in 64-row warpgroup tiles,
  a poor fit for 8-16-row draft blocks, and it would rule out pre-Hopper
  GPUs); Triton's `dot` takes any power-of-two tile >= 16 and runs on every
  CUDA GPU JAX supports. Triton IR carries no compatibility guarantee, so
  exporting it needs `jax.export.DisabledSafetyCheck.custom_call(
  "__gpu$xla.gpu.triton")` (see `TRITON_EXPORT_CHECKS`).
- both run in interpret mode on CPU (the tests do). The kernels live in
  `pallas_kernels._block_attention_kernels`, their tile math (shared with
  training) in `pallas_kernels.attention_tiles`.

Block sizes
-----------
`BlockSizes(block_q, block_kv, block_q_bwd, block_kv_bwd, num_warps,
num_stages)`; `BlockSizes.for_variant("tpu" | "gpu")` gives the defaults
(TPU: 128 query rows x 512 keys forward, 128 x 256 backward; GPU: 64 x 64
forward, 32 x 32 backward, 4 warps for Dh <= 64 and 8 above).
Tiles are clipped to the (padded) lengths. Lengths that a tile does not divide
are padded internally (the output is sliced back): for the context axis the
kernel first looks for a smaller aligned tile that divides S, because padding
the cache means copying it on every call. GPU tiles (and, on GPU only, the
head dim and the block size) are rounded to powers of two >= 16, as Triton's
`dot` needs.

Limits
------
- Inference only: `block_attention` has no VJP (`block_attention_train` has).
- k/v are cast to q's dtype (a copy if they differ; the drafter keeps them equal).
- float32 matmuls use the backend's default precision (on TPU the MXU's, on
  GPU Triton's IEEE fp32 `dot`); in interpret mode the kernels match the
  reference to float32 rounding.
- A pallas_call has no sharding rule: under a multi-device mesh call it inside
  `shard_map` (batch and kv heads split cleanly).
- Checked here by interpret mode on CPU and by lowering with `jax.export`
  (platforms "tpu" and "cuda"), which runs the Pallas -> Mosaic / Triton IR
  lowering but not the Mosaic or Triton compilers themselves; neither variant
  has been compiled or timed on an accelerator yet. The TPU layouts used
  (lane-replicated m/l/lse as [rows, 128], (rows, 1) slices of them) follow
  Mosaic's (8, 128) tiling rules.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels._block_attention_kernels import gpu_block_attention, tpu_block_attention
from pallas_kernels.common import TRITON_EXPORT_CHECKS, choose_kernel, unknown_variant
from pallas_kernels.tiling import check_positive_ints, is_triton_tile, next_pow2, pad_axis, pick_tile, sublane_align

__all__ = ["TRITON_EXPORT_CHECKS", "BlockSizes", "block_attention", "block_attention_reference"]


# --------------------------------------------------------------------------- block sizes


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the block-attention kernels.

    block_q / block_kv: query rows / context keys per tile of the forward pass
    (the inference kernel and the training forward). block_q_bwd /
    block_kv_bwd: the same for the training backward kernels (None: the forward
    values). In training a query tile holds whole blocks: its row count is
    rounded down to a multiple of the block size (at least one block).
    num_warps / num_stages: Triton launch parameters (GPU variant only;
    num_warps None: 4 for head dims <= 64, else 8).
    """

    block_q: int = 128
    block_kv: int = 512
    block_q_bwd: int | None = None
    block_kv_bwd: int | None = None
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        check_positive_ints(self, ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "num_warps", "num_stages"),
                            optional=("block_q_bwd", "block_kv_bwd", "num_warps"))

    @classmethod
    def for_variant(cls, variant: str) -> BlockSizes:
        """The default tiles of a kernel variant ("tpu" or "gpu")."""
        if variant == "tpu":
            return cls(block_q=128, block_kv=512, block_q_bwd=128, block_kv_bwd=256)
        if variant == "gpu":
            return cls(block_q=64, block_kv=64, block_q_bwd=32, block_kv_bwd=32, num_stages=2)
        raise unknown_variant(variant)

    @property
    def q_bwd(self) -> int:
        return self.block_q if self.block_q_bwd is None else self.block_q_bwd

    @property
    def kv_bwd(self) -> int:
        return self.block_kv if self.block_kv_bwd is None else self.block_kv_bwd

    def warps(self, head_dim: int) -> int:
        return self.num_warps if self.num_warps is not None else (4 if head_dim <= 64 else 8)

    def check(self, variant: str) -> BlockSizes:
        """Validates the tiles for `variant`; returns self."""
        tiles = {"block_q": self.block_q, "block_kv": self.block_kv,
                 "block_q_bwd": self.q_bwd, "block_kv_bwd": self.kv_bwd}
        for name, value in tiles.items():
            if variant == "tpu" and value % 8:
                raise ValueError(f"TPU tiles must be multiples of 8 (sublanes): BlockSizes.{name}={value}")
            if variant == "gpu" and not is_triton_tile(value):
                raise ValueError(
                    f"GPU (Triton) tiles must be powers of two >= 16: BlockSizes.{name}={value}")
        return self


def resolve_block_sizes(block_sizes: BlockSizes | None, variant: str) -> BlockSizes:
    if block_sizes is None:
        return BlockSizes.for_variant(variant)
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    return block_sizes.check(variant)


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

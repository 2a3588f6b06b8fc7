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
- both run in interpret mode on CPU (the tests do).

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
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import choose_kernel

LANES = 128  # TPU lane width: per-row statistics are kept lane-replicated
TRITON_EXPORT_CHECKS = (jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),)
DOT_NT = (((1,), (1,)), ((), ()))  # a @ b.T
DOT_NN = (((1,), (0,)), ((), ()))  # a @ b
DOT_TN = (((0,), (0,)), ((), ()))  # a.T @ b


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
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "num_warps", "num_stages"):
            value = getattr(self, name)
            if value is None and name in ("block_q_bwd", "block_kv_bwd", "num_warps"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")

    @classmethod
    def for_variant(cls, variant: str) -> BlockSizes:
        """The default tiles of a kernel variant ("tpu" or "gpu")."""
        if variant == "tpu":
            return cls(block_q=128, block_kv=512, block_q_bwd=128, block_kv_bwd=256)
        if variant == "gpu":
            return cls(block_q=64, block_kv=64, block_q_bwd=32, block_kv_bwd=32, num_stages=2)
        raise ValueError(f"unknown kernel variant {variant!r}; choose 'tpu' or 'gpu'")

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
            if variant == "gpu" and (value < 16 or value & (value - 1)):
                raise ValueError(
                    f"GPU (Triton) tiles must be powers of two >= 16: BlockSizes.{name}={value}")
        return self


def resolve_block_sizes(block_sizes: BlockSizes | None, variant: str) -> BlockSizes:
    if block_sizes is None:
        return BlockSizes.for_variant(variant)
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    return block_sizes.check(variant)


# --------------------------------------------------------------------------- tiling helpers


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def sublane_align(dtype) -> int:
    """Row alignment of a TPU tile of `dtype` (8 for 32-bit, 16 for 16-bit)."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def pick_tile(n: int, pref: int, variant: str, align: int) -> tuple[int, int]:
    """(tile, padded length) for an axis of length n tiled by at most `pref`.

    TPU: the whole axis when n <= pref (a block equal to the array dim is
    always legal), else the largest multiple of `align` in [pref/4, pref] that
    divides n (no padding copy), else `pref` rounded to `align` with n padded.
    GPU: powers of two >= 16 (Triton), the largest in [pref/4, pref] dividing
    n, else n padded.
    """
    if variant == "gpu":
        tile = min(pref, next_pow2(max(n, 16)))
        cands = [tile >> s for s in range(8) if (tile >> s) >= max(16, tile // 4)]
    else:
        if n <= pref:  # one tile spanning the whole axis is always a legal TPU block
            return n, n
        tile = max(align, pref - pref % align)
        cands = list(range(tile, max(align, tile // 4) - 1, -align))
    for cand in cands:
        if n % cand == 0:
            return cand, n
    return tile, round_up(n, tile)


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def cdiv(x, m: int):
    """Ceil division of a traced non-negative int (lax.div: no sign handling in kernels)."""
    return lax.div(x + (m - 1), m)


def dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------- in-kernel pieces


def online_step(q, k, v, mask, state, scale):
    """One online-softmax update over a key tile; state None starts a new row set.

    q [rows, D], k/v [cols, D], mask bool [rows, cols] or None; state =
    (m [rows, 1], l [rows, 1], acc [rows, D]) in float32.
    """
    s = dot(q, k, DOT_NT) * scale
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m_cur = jnp.max(s, axis=-1, keepdims=True)
    if state is None:
        m_new = m_cur
        p = jnp.exp(s - m_new)
        return m_new, jnp.sum(p, axis=-1, keepdims=True), dot(p.astype(v.dtype), v, DOT_NN)
    m_prev, l_prev, acc_prev = state
    m_new = jnp.maximum(m_prev, m_cur)
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)
    return m_new, l_new, alpha * acc_prev + dot(p.astype(v.dtype), v, DOT_NN)


def key_range_mask(rows: int, cols: int, start, limit):
    """bool [rows, cols]: key start + c < limit (limit a scalar or [rows, 1])."""
    return start + lax.broadcasted_iota(jnp.int32, (rows, cols), 1) < limit


def own_block_mask(rows: int, blocks: int, bs: int, bs_p: int):
    """bool [rows, rows] over a tile of `blocks` whole blocks of bs_p rows (bs real):
    row r sees key c iff both lie in the same block and c is a real key."""
    r = lax.broadcasted_iota(jnp.int32, (rows, rows), 0)
    c = lax.broadcasted_iota(jnp.int32, (rows, rows), 1)
    seen = None
    for n in range(blocks):
        lo = n * bs_p
        term = (r >= lo) & (r < lo + bs_p) & (c >= lo) & (c < lo + bs)
        seen = term if seen is None else seen | term
    return seen


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


# --------------------------------------------------------------------------- TPU kernel


def _tpu_kernel(lens_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, m_sc, l_sc, acc_sc, *,
                scale, block_kv, num_kv):
    b, j = pl.program_id(0), pl.program_id(3)
    length = lens_ref[b]
    rows = q_ref.shape[0]

    def store(state):
        m, lsum, acc = state
        m_sc[...] = jnp.broadcast_to(m, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(lsum, l_sc.shape)
        acc_sc[...] = acc

    @pl.when(j == 0)
    def _block_keys():
        store(online_step(q_ref[...], kb_ref[...], vb_ref[...], None, None, scale))

    def context(masked):
        mask = key_range_mask(rows, block_kv, j * block_kv, length) if masked else None
        state = (m_sc[:, :1], l_sc[:, :1], acc_sc[...])
        store(online_step(q_ref[...], kc_ref[...], vc_ref[...], mask, state, scale))

    pl.when((j + 1) * block_kv <= length)(functools.partial(context, False))
    pl.when((j * block_kv < length) & ((j + 1) * block_kv > length))(functools.partial(context, True))

    @pl.when(j == num_kv - 1)
    def _finish():
        o_ref[...] = (acc_sc[...] / l_sc[:, :1]).astype(o_ref.dtype)


def _tpu_call(q, kb, vb, kc, vc, lens, *, bq, bkv, scale, interpret):
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


def _gpu_call(q, kb, vb, kc, vc, lens, *, bq, bkv, bs, scale, interpret, sizes):
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
        out = _tpu_call(qg, kb, vb, kc, vc, lens, bq=bq, bkv=bkv, scale=scale,
                        interpret=choice.interpret)
    else:
        out = _gpu_call(qg, kb, vb, kc, vc, lens, bq=bq, bkv=bkv, bs=bs, scale=scale,
                        interpret=choice.interpret, sizes=sizes)
    return out[:, :, :rows, :d].reshape(b, h, bs, d)

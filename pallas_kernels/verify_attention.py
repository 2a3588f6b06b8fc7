"""Packed variable-length verification attention: one fused kernel per (row, kv head).

Each packed slot attends to its row's KV cache and, causally, to its row's
verified span. Layout, grids and costs: pallas_kernels/README.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._verify_attention_kernels import gpu_verify_attention, tpu_verify_attention
from pallas_kernels.common import choose_kernel, unknown_variant
from pallas_kernels.tiling import (check_positive_ints, divisor_tile, is_int, is_pow2, is_triton_tile, next_pow2,
                                   round_up, sublane_align)

# ------------------------------------------------------------------ block sizes


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the verification kernel.

    block_kv: cache keys per tile (the tile used is the largest divisor of S up
      to this; see README.md). TPU: a multiple of 8. GPU: a power of
      two >= 16.
    num_warps, num_stages: Triton launch settings (GPU only; None on TPU).
    """

    block_kv: int
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        check_positive_ints(self, ("block_kv", "num_warps", "num_stages"), optional=("num_warps", "num_stages"))
        if self.num_warps is not None and not is_pow2(self.num_warps):
            raise ValueError(f"BlockSizes.num_warps must be None or a power of two, got {self.num_warps!r}")

    @classmethod
    def for_variant(cls, variant: str) -> BlockSizes:
        """The defaults for the "tpu" or "gpu" kernel."""
        if variant == "tpu":
            return cls(block_kv=512)
        if variant == "gpu":
            return cls(block_kv=64, num_warps=4, num_stages=2)
        raise unknown_variant(variant)

    def validate(self, variant: str) -> BlockSizes:
        """Checks the sizes against a variant's constraints; returns self."""
        if variant == "tpu":
            if self.block_kv % 8:
                raise ValueError(f"TPU block_kv must be a multiple of 8 (sublanes); got {self.block_kv}")
            if self.num_warps is not None or self.num_stages is not None:
                raise ValueError("num_warps/num_stages are Triton (GPU) settings; leave them None for TPU")
        elif variant == "gpu":
            if not is_triton_tile(self.block_kv):
                raise ValueError(f"GPU block_kv must be a power of two >= 16; got {self.block_kv}")
        else:
            raise unknown_variant(variant)
        return self


# ------------------------------------------------------------------ input checks


def _check_shapes(q, k_new, v_new, cache_k, cache_v, seq_ids, offsets, valid, cache_lengths):
    """Raises ValueError on inconsistent shapes; returns (N, H, Dh, B, Hkv, S)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [N, H, Dh]; got shape {q.shape}")
    n, h, dh = q.shape
    if k_new.ndim != 3 or k_new.shape[0] != n or k_new.shape[2] != dh:
        raise ValueError(f"k_new must be [N={n}, Hkv, Dh={dh}]; got shape {k_new.shape}")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new must match k_new's shape {k_new.shape}; got {v_new.shape}")
    hkv = k_new.shape[1]
    if cache_k.ndim != 4 or cache_k.shape[1] != hkv or cache_k.shape[3] != dh:
        raise ValueError(f"cache_k must be [B, Hkv={hkv}, S, Dh={dh}]; got shape {cache_k.shape}")
    if cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_v must match cache_k's shape {cache_k.shape}; got {cache_v.shape}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    b, _, s, _ = cache_k.shape
    for name, arr in (("seq_ids", seq_ids), ("offsets", offsets), ("valid", valid)):
        if tuple(arr.shape) != (n,):
            raise ValueError(f"{name} must have shape [N={n}]; got {tuple(arr.shape)}")
    for name, arr in (("seq_ids", seq_ids), ("offsets", offsets), ("cache_lengths", cache_lengths)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array; got dtype {arr.dtype}")
    if tuple(cache_lengths.shape) != (b,):
        raise ValueError(f"cache_lengths must have shape [B={b}]; got {tuple(cache_lengths.shape)}")
    return n, h, dh, b, hkv, s


def _check_layout(seq_ids, offsets, valid, batch: int, width: int) -> None:
    """Checks a concrete layout against what the kernels assume (traced ones pass)."""
    if any(isinstance(x, jax.core.Tracer) for x in (seq_ids, offsets, valid)):
        return
    seq, off, ok = np.asarray(seq_ids), np.asarray(offsets), np.asarray(valid).astype(bool)
    seq, off = seq[ok], off[ok]
    if seq.size and (seq.min() < 0 or seq.max() >= batch):
        raise ValueError(f"valid slots must have seq_ids in [0, {batch}); got {sorted(set(seq.tolist()))}")
    if off.size and (off.min() < 0 or off.max() >= width):
        raise ValueError(f"valid slots must have offsets in [0, width={width}); got range "
                         f"[{off.min()}, {off.max()}] (pass the layout's block size as width)")
    if len(set(zip(seq.tolist(), off.tolist()))) != seq.size:
        raise ValueError("each (seq_id, offset) pair may occur in at most one valid slot")


# ------------------------------------------------------------------ reference


def verify_attention_reference(q, k_new, v_new, cache_k, cache_v, seq_ids, offsets, valid,
                               cache_lengths):
    """The definition, in plain jnp with an explicit mask (see README.md).

    Gathers each slot's row of the cache ([N, Hkv, S, Dh]: N / B times the
    cache), so it is meant for tests and CPU; the model's efficient XLA form is
    `models.layers.packed_attention`. Everything runs in float32; returns
    [N, H, Dh] in q's dtype with zeros for padding slots.
    """
    n, h, dh, b, hkv, s = _check_shapes(q, k_new, v_new, cache_k, cache_v, seq_ids, offsets, valid,
                                        cache_lengths)
    g = h // hkv
    hi = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    seq = jnp.clip(seq_ids.astype(jnp.int32), 0, b - 1)
    off = offsets.astype(jnp.int32)
    ok = valid.astype(bool)
    qg = q.astype(f32).reshape(n, hkv, g, dh)
    row_k, row_v = cache_k[seq].astype(f32), cache_v[seq].astype(f32)  # [N, Hkv, S, Dh]
    s_cache = jnp.einsum("nkgd,nksd->nkgs", qg, row_k, precision=hi)
    s_new = jnp.einsum("nkgd,mkd->nkgm", qg, k_new.astype(f32), precision=hi)
    scores = jnp.concatenate([s_cache, s_new], axis=-1) * (1.0 / math.sqrt(dh))
    m_cache = jnp.arange(s)[None] < cache_lengths.astype(jnp.int32)[seq][:, None]  # [N, S]
    m_new = ok[None] & (seq[None] == seq[:, None]) & (off[None] <= off[:, None])  # [N, N]
    mask = jnp.concatenate([m_cache, m_new], axis=-1) & ok[:, None]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    out = (jnp.einsum("nkgs,nksd->nkgd", probs[..., :s], row_v, precision=hi)
           + jnp.einsum("nkgm,mkd->nkgd", probs[..., s:], v_new.astype(f32), precision=hi))
    out = jnp.where(ok[:, None, None, None], out, 0.0)
    return out.reshape(n, h, dh).astype(q.dtype)


# ------------------------------------------------------------------ entry point


def verify_attention(q, k_new, v_new, cache_k, cache_v, seq_ids, offsets, valid, cache_lengths, *,
                     impl: str = "auto", variant: str | None = None, interpret: bool | None = None,
                     block_sizes: BlockSizes | None = None, width: int | None = None):
    """Packed verification attention (see README.md).

    q [N, H, Dh], k_new/v_new [N, Hkv, Dh] (the packed tokens' own K/V),
    cache_k/cache_v [B, Hkv, S, Dh], seq_ids/offsets int [N], valid bool [N],
    cache_lengths int [B]. Returns [N, H, Dh] in q's dtype; padding slots are
    zeros.

    impl/variant/interpret: see `pallas_kernels.common.choose_kernel` ("xla" is
    `verify_attention_reference`). block_sizes: defaults to
    `BlockSizes.for_variant(variant)`. width: static bound on every row's
    verified length (the layout's block size; 1 for the AR step); defaults to N.
    """
    n, h, dh, b, hkv, s = _check_shapes(q, k_new, v_new, cache_k, cache_v, seq_ids, offsets, valid,
                                        cache_lengths)
    choice = choose_kernel(impl, variant, interpret)
    width = n if width is None else width
    if not is_int(width) or width < 1:
        raise ValueError(f"width must be a positive int; got {width!r}")
    width = int(width)
    if not choice.use_pallas or n == 0:
        return verify_attention_reference(q, k_new, v_new, cache_k, cache_v, seq_ids, offsets, valid,
                                          cache_lengths)
    kind = choice.variant
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None; got {type(block_sizes).__name__}")
    sizes = (block_sizes or BlockSizes.for_variant(kind)).validate(kind)
    if s < 1:
        raise ValueError("the cache must have at least one slot (S >= 1)")
    if kind == "gpu" and not is_triton_tile(dh):
        raise ValueError(f"the GPU kernel needs a power-of-two head dim >= 16; got Dh={dh}")
    _check_layout(seq_ids, offsets, valid, b, width)
    block_kv = divisor_tile(s, sizes.block_kv, kind, jnp.dtype(cache_k.dtype).itemsize)

    g = h // hkv
    dtype = q.dtype
    # Each row's slots at width W: slot_of[b, t] is the slot of row b's token t, N where absent.
    seq = seq_ids.astype(jnp.int32)
    off = offsets.astype(jnp.int32)
    ok = valid.astype(bool)
    slot_of = jnp.full((b, width), n, jnp.int32).at[jnp.where(ok, seq, b), off].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")
    present = slot_of < n
    gather = jnp.minimum(slot_of, n - 1)
    eff_len = jnp.where(jnp.any(present, axis=1),
                        jnp.clip(cache_lengths.astype(jnp.int32), 0, s), 0)  # 0: the row has no work

    if kind == "tpu":
        rows = round_up(width * g, sublane_align(dtype))  # whole sublane tiles
        keys = round_up(width, 128)  # a lane-aligned [R, 128] score tile for the new keys
    else:
        rows = max(16, next_pow2(width * g))
        keys = max(16, next_pow2(width))

    q_rows = q[gather].reshape(b, width, hkv, g, dh).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(b, hkv, width * g, dh)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - width * g), (0, 0)))

    def new_rows(x):  # [N, Hkv, Dh] -> [B, Hkv, keys, Dh]
        x = x.astype(dtype)[gather].transpose(0, 2, 1, 3)
        return jnp.pad(x, ((0, 0), (0, 0), (0, keys - width), (0, 0)))

    key_ok = jnp.pad(present.astype(jnp.int32), ((0, 0), (0, keys - width)))
    args = (q_rows, cache_k, cache_v, new_rows(k_new), new_rows(v_new), key_ok, eff_len)
    common = {"block_kv": block_kv, "group": g, "scale": 1.0 / math.sqrt(dh), "interpret": choice.interpret}
    if kind == "tpu":
        out = tpu_verify_attention(*args, **common)
    else:
        out = gpu_verify_attention(*args, **common, num_warps=sizes.num_warps, num_stages=sizes.num_stages)

    out = out[:, :, :width * g].reshape(b, hkv, width, g, dh).transpose(0, 2, 1, 3, 4)
    out = out.reshape(b, width, h, dh)[jnp.clip(seq, 0, b - 1), jnp.clip(off, 0, width - 1)]
    return jnp.where(ok[:, None, None], out, jnp.zeros((), dtype))

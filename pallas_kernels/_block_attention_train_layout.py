"""Static layout and block maps of the training block-attention kernels.

`TrainGeometry` fixes, per call, the padded sizes and the tiles that the
forward and the three backward kernels of `pallas_kernels.block_attention_train`
share (a query tile always holds whole blocks). The block maps say which
context tiles each query tile must visit, so that fully masked tiles are
neither fetched nor computed, in the forward and in the backward.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from pallas_kernels._block_attention_types import BlockSizes
from pallas_kernels.attention_tiles import cdiv
from pallas_kernels.tiling import next_pow2, pad_axis, pick_tile, round_up, sublane_align


@dataclasses.dataclass(frozen=True)
class TrainGeometry:
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


def train_geometry(variant, interpret, sizes, q, ctx_k, block_size) -> TrainGeometry:
    """Picks the tiles for q [B, H, N*Bs, Dh] and ctx_k [B, Hkv, T, Dh] under `sizes`."""
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
    return TrainGeometry(variant, interpret, sizes, h // ctx_k.shape[1], n, round_up(n, nb), block_size, bs_p,
                         t, t_pad, d, d_p, nb, nb_b, bkv, bkv_b)


def pad_rows(x, geo: TrainGeometry):
    """[B, heads, N*Bs, D] -> [B, heads, n_pad*bs_p, d_p] (padding each block and the block count)."""
    b, h = x.shape[:2]
    x = x.reshape(b, h, geo.n, geo.bs, x.shape[-1])
    x = pad_axis(pad_axis(pad_axis(x, 2, geo.n_pad), 3, geo.bs_p), 4, geo.d_p)
    return x.reshape(b, h, geo.rows, geo.d_p)


def unpad_rows(x, geo: TrainGeometry):
    """The inverse of `pad_rows`."""
    b, h = x.shape[:2]
    x = x.reshape(b, h, geo.n_pad, geo.bs_p, geo.d_p)[:, :, :geo.n, :geo.bs, :geo.d]
    return x.reshape(b, h, geo.n * geo.bs, geo.d)


def row_limits(anchors_p, geo: TrainGeometry):
    """int [B, rows]: each query row's anchor (GPU kernels read it as a vector)."""
    return jnp.repeat(anchors_p, geo.bs_p, axis=1)


def block_map(anchors_p, nb, bkv):
    """Per query tile: context tiles to visit, and how many of them need no mask."""
    a = anchors_p.reshape(anchors_p.shape[0], -1, nb)
    return cdiv(jnp.max(a, -1), bkv).astype(jnp.int32), lax.div(jnp.min(a, -1), bkv).astype(jnp.int32)


def visit_lists(counts, nk):
    """Per context tile: the query tiles that visit it (first `qcount`, then the last one repeated)."""
    nq = counts.shape[1]
    visit = counts[:, None, :] > jnp.arange(nk, dtype=jnp.int32)[None, :, None]  # [B, nk, nq]
    qcount = jnp.sum(visit, -1).astype(jnp.int32)
    order = jnp.argsort(~visit, axis=-1, stable=True).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(qcount - 1, 0)[..., None], -1)
    return jnp.where(jnp.arange(nq)[None, None] < qcount[..., None], order, last), qcount

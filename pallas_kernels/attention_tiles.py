"""In-kernel tile math of the block-attention kernels (inference and training, TPU and GPU).

One online-softmax step, the masks the drafter's blocks need, the
flash-attention-2 backward tile gradients and the VMEM scratch bookkeeping of
the TPU kernels: written once here so that the four kernel variants agree on
every number they compute.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.tiling import DOT_NN, DOT_NT, DOT_TN, dot


def cdiv(x, m: int):
    """Ceil division of a traced non-negative int (lax.div: no sign handling in kernels)."""
    return lax.div(x + (m - 1), m)


# --------------------------------------------------------------------------- masks


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


# --------------------------------------------------------------------------- forward


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


def store_state(m_sc, l_sc, acc_sc, state):
    """Writes an online-softmax state into TPU scratch (m and l lane-replicated)."""
    m, lsum, acc = state
    m_sc[...] = jnp.broadcast_to(m, m_sc.shape)
    l_sc[...] = jnp.broadcast_to(lsum, l_sc.shape)
    acc_sc[...] = acc


def load_state(m_sc, l_sc, acc_sc):
    """The online-softmax state kept in TPU scratch, as online_step takes it."""
    return m_sc[:, :1], l_sc[:, :1], acc_sc[...]


# --------------------------------------------------------------------------- backward


def _probs(q, k, lse, mask, scale):
    s = dot(q, k, DOT_NT) * scale
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return jnp.exp(s - lse)


def dq_tile(q, k, v, do, lse, delta, mask, scale):
    """One key tile's contribution to dq (unscaled), recomputing the probabilities from lse."""
    p = _probs(q, k, lse, mask, scale)
    ds = p * (dot(do, v, DOT_NT) - delta)
    return dot(ds.astype(k.dtype), k, DOT_NN)


def dkv_tile(q, k, v, do, lse, delta, mask, scale):
    """One query tile's contribution to (dk unscaled, dv) of a key tile."""
    p = _probs(q, k, lse, mask, scale)
    dv = dot(p.astype(do.dtype), do, DOT_TN)
    ds = p * (dot(do, v, DOT_NT) - delta)
    return dot(ds.astype(q.dtype), q, DOT_TN), dv


def write_dkv(dk_ref, dv_ref, dk, dv, scale):
    """Writes accumulated (dk, dv) of a key tile; dk takes the softmax scale here, once."""
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

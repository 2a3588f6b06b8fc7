"""The TPU (Mosaic) and GPU (Triton) kernels behind `pallas_kernels.fused_verify.verify_head`.

Both stream the LM-head matrix through on-chip memory one vocab tile at a time
and fold each tile of logits into running per-position reductions
(`_fold_tile`); each vocab split writes partials that `_combine` merges. See
pallas_kernels/README.md for the grids, the tiles and the costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._fused_verify_types import BlockSizes, Problem
from pallas_kernels.counter_hash import gumbel_from_bits, hash_bits, lane_hash
from pallas_kernels.tiling import DOT_NN, DOT_NT, dot, next_pow2, round_up


# ----------------------------------------------------------------------------------------------
# The shared per-tile update: folds one [tn, tv] tile of tempered logits into the running state.
# State entries are [tn, 1] float32: max, argmax id, sum exp(z - max), draft logit and, when
# sampling, the best Gumbel score and its id. Ids travel as float32 (exact below 2**24).


def _best(scores, cols_f):
    best = jnp.max(scores, axis=1, keepdims=True)
    at = jnp.min(jnp.where(scores == best, cols_f, jnp.inf), axis=1, keepdims=True)
    return best, at


def _fold_tile(state, z, cols, vocab, draft, exclude, keys, sample):
    """z [tn, tv] float32, cols int32 [1, tv] (logical ids), draft/exclude/keys int32 [tn, 1]."""
    valid = cols < vocab
    z = jnp.where(valid, z, -jnp.inf)
    cols_f = cols.astype(jnp.float32)
    m_old, idx_old, s_old, dl_old = state[:4]
    t_max, t_arg = _best(z, cols_f)
    m_new = jnp.maximum(m_old, t_max)
    idx_new = jnp.where(t_max > m_old, t_arg, idx_old)  # strict: earlier tiles win ties
    s_new = s_old * jnp.exp(m_old - m_new) + jnp.sum(jnp.exp(z - m_new), axis=1, keepdims=True)
    dl_new = jnp.maximum(dl_old, jnp.max(jnp.where(cols == draft, z, -jnp.inf), axis=1, keepdims=True))
    new = [m_new, idx_new, s_new, dl_new]
    if sample:
        g_old, gi_old = state[4:]
        scores = z + gumbel_from_bits(hash_bits(keys, lane_hash(cols)))
        scores = jnp.where(cols == exclude, -jnp.inf, scores)
        g_max, g_arg = _best(scores, cols_f)
        new += [jnp.maximum(g_old, g_max), jnp.where(g_max > g_old, g_arg, gi_old)]
    return new


def _initial_state(shape, sample):
    neg = jnp.full(shape, -jnp.inf, jnp.float32)
    zero = jnp.zeros(shape, jnp.float32)
    return [neg, zero, zero, neg] + ([neg, zero] if sample else [])


def _combine(parts, n, sample):
    """Merges per-split partials [S, Np] (splits in vocab order) into per-position
    (argmax, lse, draft_logit, sample), each [n]."""
    parts = [x[:, :n] for x in parts]

    def first_best(score, ids):
        best = jnp.max(score, axis=0)
        split = jnp.argmax(score == best[None], axis=0)  # lowest split = lowest id on ties
        return best, jnp.take_along_axis(ids, split[None], axis=0)[0].astype(jnp.int32)

    m, idx, s, dl = parts[:4]
    m_all, argmax = first_best(m, idx)
    lse = m_all + jnp.log(jnp.sum(s * jnp.exp(m - m_all[None]), axis=0))
    draft_logit = jnp.max(dl, axis=0)
    sample_ids = first_best(*parts[4:])[1] if sample else argmax
    return argmax, lse, draft_logit, sample_ids


# ----------------------------------------------------------------------------------------------
# TPU (Mosaic) variant.


def _tpu_kernel(inv_t_ref, h_ref, w_ref, *refs, vocab, tv, tiles_per_split, layout, sample):
    n_in = 3 if sample else 1
    id_refs, rest = refs[:n_in], refs[n_in:]
    n_state = 6 if sample else 4
    out_refs, state_refs = rest[:n_state], rest[n_state:]
    split, j = pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        for ref, value in zip(state_refs, _initial_state(state_refs[0].shape, sample)):
            ref[...] = value

    h = h_ref[...]
    w = w_ref[...].astype(h.dtype)
    z = dot(h, w, DOT_NN if layout == "dv" else DOT_NT)
    if sample:
        z = z * inv_t_ref[0]
    cols = (split * tiles_per_split + j) * tv + lax.broadcasted_iota(jnp.int32, (1, tv), 1)
    draft = id_refs[0][...]
    exclude, keys = (id_refs[1][...], id_refs[2][...]) if sample else (None, None)
    new = _fold_tile([ref[...] for ref in state_refs], z, cols, vocab, draft, exclude, keys, sample)
    for ref, value in zip(state_refs, new):
        ref[...] = value

    @pl.when(j == tiles_per_split - 1)
    def _write():
        for out, ref in zip(out_refs, state_refs):
            out[...] = ref[...]


def _tpu_call(p: Problem, h, w, ids, inv_t, *, tn, tv, splits, tiles_per_split, num_vocab_tiles,
              bs: BlockSizes, interpret: bool):
    n_pad, d = h.shape
    last = num_vocab_tiles - 1
    if p.layout == "dv":
        w_spec = pl.BlockSpec((d, tv), lambda i, s, j: (0, jnp.minimum(s * tiles_per_split + j, last)))
    else:
        w_spec = pl.BlockSpec((tv, d), lambda i, s, j: (jnp.minimum(s * tiles_per_split + j, last), 0))
    row_spec = pl.BlockSpec((tn, 1), lambda i, s, j: (i, 0))
    n_state = 6 if p.sample else 4
    out_spec = pl.BlockSpec((None, tn, 1), lambda i, s, j: (s, i, 0))

    vmem_limit = bs.vmem_limit_bytes
    if vmem_limit is None:
        need = (2 * tn * d * h.dtype.itemsize + 2 * tv * d * w.dtype.itemsize
                + (tv * d * h.dtype.itemsize if w.dtype != h.dtype else 0) + 8 * tn * tv * 4)
        if need > 12 * 2 ** 20:
            vmem_limit = min(int(need * 1.5), 64 * 2 ** 20)  # within every generation's VMEM
    flops = 2 * n_pad * d * num_vocab_tiles * tv
    cost = pl.CostEstimate(
        flops=flops, transcendentals=n_pad * num_vocab_tiles * tv * (3 if p.sample else 1),
        bytes_accessed=(w.size * w.dtype.itemsize * (n_pad // tn) + h.size * h.dtype.itemsize
                        + n_state * splits * n_pad * 4))
    call = pl.pallas_call(
        functools.partial(_tpu_kernel, vocab=p.vocab, tv=tv, tiles_per_split=tiles_per_split,
                          layout=p.layout, sample=p.sample),
        grid=(n_pad // tn, splits, tiles_per_split),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec((tn, d), lambda i, s, j: (i, 0)),
                  w_spec] + [row_spec] * len(ids),
        out_specs=[out_spec] * n_state,
        out_shape=[jax.ShapeDtypeStruct((splits, n_pad, 1), jnp.float32)] * n_state,
        scratch_shapes=[pltpu.VMEM((tn, 1), jnp.float32)] * n_state,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit),
        cost_estimate=cost,
        interpret=interpret,
        name="fused_verify_head_tpu",
    )
    parts = call(inv_t, h, w, *(x[:, None] for x in ids))
    return [x[..., 0] for x in parts]


# ----------------------------------------------------------------------------------------------
# GPU (Pallas Triton) variant.


def _gpu_kernel(inv_t_ref, h_ref, w_ref, *refs, vocab, d, tn, tv, kd, tiles_per_split, layout, sample):
    n_in = 3 if sample else 1
    id_refs, out_refs = refs[:n_in], refs[n_in:]
    row_block, split = pl.program_id(0), pl.program_id(1)
    rows = row_block * tn + jnp.arange(tn, dtype=jnp.int32)
    ids = [plgpu.load(ref.at[rows])[:, None] for ref in id_refs]
    draft = ids[0]
    exclude, keys = (ids[1], ids[2]) if sample else (None, None)
    inv_t = plgpu.load(inv_t_ref.at[jnp.zeros((1,), jnp.int32)]).reshape(1, 1)
    num_k = pl.cdiv(d, kd)

    def tile(t, state):
        cols = (split * tiles_per_split + t) * tv + jnp.arange(tv, dtype=jnp.int32)
        col_ok = cols < vocab

        def chunk(k, acc):
            dk = k * kd + jnp.arange(kd, dtype=jnp.int32)
            d_ok = dk < d
            h_mask = jnp.broadcast_to(d_ok[None, :], (tn, kd))
            hb = plgpu.load(h_ref.at[rows[:, None], dk[None, :]], mask=h_mask, other=0.0)
            w_mask = d_ok[:, None] & col_ok[None, :]
            w_at = (w_ref.at[dk[:, None], cols[None, :]] if layout == "dv"
                    else w_ref.at[cols[None, :], dk[:, None]])
            wb = plgpu.load(w_at, mask=w_mask, other=0.0).astype(hb.dtype)
            return acc + jnp.dot(hb, wb, preferred_element_type=jnp.float32)

        z = lax.fori_loop(0, num_k, chunk, jnp.zeros((tn, tv), jnp.float32))
        if sample:
            z = z * inv_t
        return tuple(_fold_tile(list(state), z, cols[None, :], vocab, draft, exclude, keys, sample))

    state = lax.fori_loop(0, tiles_per_split, tile, tuple(_initial_state((tn, 1), sample)))
    for out, value in zip(out_refs, state):
        plgpu.store(out.at[split, rows], value[:, 0])


def _gpu_call(p: Problem, h, w, ids, inv_t, *, tn, tv, kd, splits, tiles_per_split, bs: BlockSizes,
              interpret: bool):
    n_pad, d = h.shape
    n_state = 6 if p.sample else 4
    call = pl.pallas_call(
        functools.partial(_gpu_kernel, vocab=p.vocab, d=d, tn=tn, tv=tv, kd=kd,
                          tiles_per_split=tiles_per_split, layout=p.layout, sample=p.sample),
        grid=(n_pad // tn, splits),
        out_shape=[jax.ShapeDtypeStruct((splits, n_pad), jnp.float32)] * n_state,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="fused_verify_head_gpu",
    )
    return call(inv_t, h, w, *ids)


# ----------------------------------------------------------------------------------------------
# Entry point.


def pallas_verify_head(p: Problem, h, w, draft, exclude, keys, inv_t, variant, interpret, bs: BlockSizes):
    """h [N, D] and the flat per-position ids -> (argmax, lse, draft_logit, sample), each [N]."""
    bs.validate(variant)
    if variant == "tpu":
        tn = min(bs.token_tile, round_up(p.n, 16))
        tv = min(bs.vocab_tile, round_up(p.vocab, 128))
    else:
        tn = min(bs.token_tile, max(16, next_pow2(p.n)))
        tv = min(bs.vocab_tile, max(16, next_pow2(p.vocab)))
    num_vocab_tiles = pl.cdiv(p.vocab, tv)
    tiles_per_split = pl.cdiv(num_vocab_tiles, min(bs.vocab_splits, num_vocab_tiles))
    splits = pl.cdiv(num_vocab_tiles, tiles_per_split)  # every split starts inside the vocab
    n_pad = round_up(p.n, tn)
    pad = n_pad - p.n
    h = jnp.pad(h, ((0, pad), (0, 0)))
    ids = [draft] + ([exclude, keys] if p.sample else [])
    ids = [jnp.pad(x, (0, pad), constant_values=-1) for x in ids]
    if variant == "tpu":
        parts = _tpu_call(p, h, w, ids, inv_t, tn=tn, tv=tv, splits=splits, tiles_per_split=tiles_per_split,
                          num_vocab_tiles=num_vocab_tiles, bs=bs, interpret=interpret)
    else:
        kd = min(bs.d_tile, max(16, next_pow2(p.d)))
        parts = _gpu_call(p, h, w, ids, inv_t, tn=tn, tv=tv, kd=kd, splits=splits,
                          tiles_per_split=tiles_per_split, bs=bs, interpret=interpret)
    return _combine(parts, p.n, p.sample)

"""Fused verification head: the target's LM head and the verify reductions in one pass over the vocab.

Speculative verification needs only a few numbers per verified position, but the
plain path materialises the full logits first (`target.logits(hidden)` [N, V]
in float32, then argmax or log-softmax). This kernel streams the LM-head matrix
W through on-chip memory one vocab tile at a time, computes the tile's logits
for a tile of positions, and folds them into running per-position reductions,
so the [N, V] logits never reach HBM.

What `verify_head` returns per position (VerifyHeadOut, each [...]):

- `argmax`: the id of the largest logit (ties -> lowest id, like jnp.argmax);
- `lse`: logsumexp(z), where z = logits * (1 / T) is the tempered logits
  (T = 1 when greedy, so z = logits);
- `draft_logit`: z[draft_ids] (-inf for an id outside [0, V)), so
  log p(draft) = draft_logit - lse;
- `sample`: greedy: the argmax. T > 0: a draw from softmax(z) restricted to the
  ids != exclude_ids, i.e. p(v) ∝ exp(logits[v] / T) for v != exclude, by
  Gumbel-max: argmax_v (z[v] + g[v]) with g[v] = -log(-log u[v]). The uniforms
  u come from a stateless counter-based hash of (seed, counter, vocab id) done
  with 32-bit integer ops in the kernel (`position_keys`, `_hash_bits`), so the
  kernel, the reference and both variants draw the same sample for the same
  (seed, counter). u is quantised to 23 bits (u in [2**-24, 1 - 2**-24], so
  g is finite, within about [-2.8, 16.6]); up to that quantisation and the hash's quality the sample follows softmax(z)
  exactly. Top-p is not supported: callers fall back to the reference
  path (`adaflash_jax.decoding.sampling.target_log_probs`) when top_p < 1.

`fused_verify` composes these into the per-sequence acceptance for drafts laid
out as in `adaflash_jax.decoding.acceptance` (row: verified block [bonus, d_1 ..
d_{Bs-1}], verify_len per row). Greedy: the argmax-match rule (exactly
`greedy_accept_ids`). T > 0, argmax drafts (q one-hot): accept d_{i+1} with
probability p_i(d_{i+1}) = exp(draft_logit_i - lse_i), using a counter-based
uniform from the same hash on a reserved lane; the next token is the sample at
the first rejected position, drawn from p with the rejected draft removed
(the residual norm(max(0, p - q)) for one-hot q), or a plain sample from p
after every verified draft is accepted. Each position's excluded id is known
before the kernel runs (the draft it verifies, or none at the last verified
position), so one kernel pass yields every candidate.

Layout: W is [D, V] (`weight_layout="dv"`, an untied LM head as the target
stores it) or [V, D] (`"vd"`, the tied embedding table), read in place either
way. hidden and W may be bfloat16, float16 or float32; W tiles are cast to
hidden's dtype (as `Target.logits` does) and logits accumulate in float32
(float32 operands multiply in full float32 on both variants).

Variants and block sizes (`BlockSizes`, defaults per variant from
`BlockSizes.for_variant`):

- TPU (Mosaic): grid (token tiles, vocab splits, vocab tiles per split), the
  last axis "arbitrary"; the running max / argmax / sum-exp / draft logit /
  best Gumbel score / its id live in VMEM scratch [token_tile, 1] and are
  written once per (token tile, split). Defaults token_tile=256,
  vocab_tile=512, vocab_splits=2 (the splits are "parallel", so two-core
  chips share the vocab). The VMEM limit is raised when the double-buffered
  tiles need it.
- GPU (Pallas Triton): grid (token tiles, vocab splits); each program runs an
  in-kernel fori_loop over its vocab tiles and, inside it, over d_tile-wide
  chunks of D with masked loads (Triton needs power-of-two tiles; SmolLM2's
  D = 576 is not one). Defaults token_tile=32, vocab_tile=128, d_tile=64,
  vocab_splits=64, num_warps=4, num_stages=2. Triton, not Mosaic GPU: the
  Triton lowering is plain MLIR generation, so `jax.export(...,
  platforms=("cuda",))` lowers it on a CPU host, its masked gathers handle
  ragged D and V directly, and one kernel serves Ampere as well as Hopper;
  the Mosaic GPU model is built around Hopper/Blackwell features
  (warpgroups, TMA, WGMMA) and would need that machinery, per generation, to
  beat Triton on what is a small matmul plus row reductions (a trivial Mosaic
  GPU kernel also lowers here; this one was not written for it). The
  token-tile grid axis is the fastest-varying launch axis, so the programs
  reading one vocab split's W slice are launched together and can share it
  through L2. Costs of the choice: Pallas Triton
  is deprecated upstream in favour of Mosaic GPU, and its custom call
  ("__gpu$xla.gpu.triton") is not on jax.export's list of stable targets, so
  serialising an export needs
  `disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]`
  (jit on a GPU is unaffected). Should Triton be removed, the reference path
  still serves GPUs.

Both variants write partial results per vocab split ([splits, N] each) that a
few jnp ops combine (keeping the lowest id on ties), so the split count
changes parallelism, not the ids chosen (lse only by float rounding). A vocab size that is not a multiple of the
tile (SmolLM2's 49,152 is, Qwen3's 151,936 = 1187 x 128 is not a multiple of
512) is handled in the kernel: columns >= V are masked to -inf before any
reduction, so padded columns never win, add nothing to the sum and are never
sampled. Token counts are padded to the token tile (hidden rows are cheap).

HBM traffic saved: the plain path writes [N, V] float32 logits and reads them
back at least once; at Qwen3's V = 151,936 and N = 256 that is 155 MB per
verify step each way. Here only W (read once per token tile) and hidden come
in, and a few [splits, N] float32 partials go out.

Limits: V < 2**24 (ids are carried as float32 in the reductions); temperature
is a Python number or a traced positive scalar (a traced temperature is taken
to be > 0 and selects the sampling path); counters must differ between
positions (and between steps, or the seed must change) for independent draws.
Checked on a CPU host only: both variants in interpret mode against the
reference, and lowering for TPU and CUDA with `jax.export`; Mosaic's and
Triton's later compile stages run only on the accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from adaflash_jax.decoding.acceptance import greedy_accept_ids
from pallas_kernels.common import choose_kernel

WEIGHT_LAYOUTS = ("dv", "vd")
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_VOCAB = 1 << 24
ACCEPT_LANE = -1  # hash lane of the acceptance uniform; vocab lanes are 0 .. V-1


# ----------------------------------------------------------------------------------------------
# Counter-based randomness: 32-bit integer hashing shared by the kernels and the reference.


def _i32(c: int) -> np.int32:
    """A 32-bit constant as a (wrapped) signed int32."""
    return np.int32(c - (1 << 32) if c >= (1 << 31) else c)


_MUL1 = _i32(0x85EBCA6B)
_MUL2 = _i32(0xC2B2AE35)
_GOLDEN = _i32(0x9E3779B9)
_SEED_SALT = _i32(0x68E31DA4)


def _srl(x, bits: int):
    return lax.shift_right_logical(x, np.int32(bits))


def _mix32(x):
    """A bijective avalanche mix of int32 (the MurmurHash3 finaliser); multiplies wrap."""
    x = x ^ _srl(x, 16)
    x = x * _MUL1
    x = x ^ _srl(x, 13)
    x = x * _MUL2
    return x ^ _srl(x, 16)


def position_keys(seed, counters) -> jax.Array:
    """int32 key per position from a scalar seed and int counters: distinct counters give
    distinct keys for one seed (both steps are bijections)."""
    seed_mix = _mix32(jnp.asarray(seed, jnp.int32) ^ _SEED_SALT)
    return _mix32(seed_mix ^ jnp.asarray(counters, jnp.int32))


def _lane_hash(lanes):
    return _mix32(lanes * _GOLDEN)


def _hash_bits(keys, lane_hash):
    """32 random bits for (position key, lane); keys and lane_hash broadcast."""
    return _mix32(keys ^ lane_hash)


def _uniform(bits):
    """The top 23 bits as a float32 uniform in (0, 1): cell centres, exact in float32, so the
    extremes are 2**-24 and 1 - 2**-24 and the Gumbel transform stays finite (24 bits would
    round the top cell to 1.0, whose Gumbel is +inf)."""
    return (_srl(bits, 9).astype(jnp.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)


def _gumbel(bits):
    return -jnp.log(-jnp.log(_uniform(bits)))


def acceptance_uniforms(keys) -> jax.Array:
    """float32 uniforms in (0, 1) for the accept/reject draw at each position (lane -1)."""
    keys = jnp.asarray(keys, jnp.int32)
    return _uniform(_hash_bits(keys, _lane_hash(jnp.full((), ACCEPT_LANE, jnp.int32))))


def gumbel_noise(keys, num_lanes: int) -> jax.Array:
    """float32 [..., num_lanes]: the Gumbel noise the sampler adds at vocab ids 0 .. num_lanes-1."""
    keys = jnp.asarray(keys, jnp.int32)
    lanes = jnp.arange(num_lanes, dtype=jnp.int32)
    return _gumbel(_hash_bits(keys[..., None], _lane_hash(lanes)))


# ----------------------------------------------------------------------------------------------
# Public types.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Kernel tiling.

    token_tile: positions per tile (TPU: a multiple of 8; GPU: a power of two >= 16).
    vocab_tile: vocab columns per tile (TPU: a multiple of 128; GPU: a power of two >= 16).
    vocab_splits: vocab ranges reduced in parallel and combined afterwards (>= 1).
    d_tile: GPU only, the contraction chunk of D (a power of two >= 16); TPU takes all of D.
    num_warps, num_stages: GPU (Triton) launch parameters; None = Triton's defaults.
    vmem_limit_bytes: TPU only; None = raised automatically when the tiles need it.
    Tiles larger than the problem are shrunk to fit, so the defaults suit any size.
    """

    token_tile: int
    vocab_tile: int
    vocab_splits: int = 1
    d_tile: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        for name in ("token_tile", "vocab_tile", "vocab_splits", "d_tile"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")
        for name in ("num_warps", "num_stages", "vmem_limit_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"BlockSizes.{name} must be None or a positive int, got {value!r}")

    @classmethod
    def for_variant(cls, variant: str) -> BlockSizes:
        if variant == "tpu":
            return cls(token_tile=256, vocab_tile=512, vocab_splits=2)
        if variant == "gpu":
            return cls(token_tile=32, vocab_tile=128, vocab_splits=64, d_tile=64, num_warps=4, num_stages=2)
        raise ValueError(f"unknown kernel variant {variant!r}; choose 'tpu' or 'gpu'")

    def validate(self, variant: str) -> None:
        """Raises ValueError if these sizes cannot tile the given variant."""
        if variant == "tpu":
            if self.token_tile % 8:
                raise ValueError(f"TPU token_tile must be a multiple of 8, got {self.token_tile}")
            if self.vocab_tile % 128:
                raise ValueError(f"TPU vocab_tile must be a multiple of 128, got {self.vocab_tile}")
        elif variant == "gpu":
            for name in ("token_tile", "vocab_tile", "d_tile"):
                value = getattr(self, name)
                if value < 16 or value & (value - 1):
                    raise ValueError(f"GPU {name} must be a power of two >= 16, got {value}")
        else:
            raise ValueError(f"unknown kernel variant {variant!r}; choose 'tpu' or 'gpu'")


class VerifyHeadOut(NamedTuple):
    """Per-position results, each shaped like hidden.shape[:-1] (see the module docstring)."""

    argmax: jax.Array       # int32
    lse: jax.Array          # float32, logsumexp(logits / T) (T = 1 when greedy)
    draft_logit: jax.Array  # float32, (logits / T)[draft_ids]; -inf outside [0, V)
    sample: jax.Array       # int32, the argmax when greedy


# ----------------------------------------------------------------------------------------------
# Argument checks shared by the kernel and the reference.


@dataclasses.dataclass(frozen=True)
class _Problem:
    positions: tuple[int, ...]
    n: int
    d: int
    vocab: int
    layout: str
    sample: bool


def _is_python_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _check_ids(name, ids, positions):
    ids = jnp.asarray(ids)
    if ids.shape != positions:
        raise ValueError(f"{name} must have shape {positions} (hidden.shape[:-1]), got {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {ids.dtype}")
    return ids.astype(jnp.int32).reshape(-1)


def _prepare(hidden, lm_head, draft_ids, temperature, seed, counters, exclude_ids, weight_layout):
    """Validates the arguments; returns (problem, h [N, D], draft, exclude, keys, inv_t [1])."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    if hidden.ndim < 1 or lm_head.ndim != 2:
        raise ValueError(f"hidden must be [..., D] and lm_head 2-D, got {hidden.shape} and {lm_head.shape}")
    for name, x in (("hidden", hidden), ("lm_head", lm_head)):
        if not any(x.dtype == dt for dt in _FLOAT_DTYPES):
            raise ValueError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    d = hidden.shape[-1]
    d_w, vocab = lm_head.shape if weight_layout == "dv" else lm_head.shape[::-1]
    if d_w != d:
        raise ValueError(f"lm_head {lm_head.shape} (layout {weight_layout!r}) does not match hidden D={d}")
    if not 0 < vocab < _MAX_VOCAB or d < 1:
        raise ValueError(f"need 0 < V < 2**24 and D >= 1, got V={vocab}, D={d}")
    positions = tuple(hidden.shape[:-1])
    n = math.prod(positions)
    if n < 1:
        raise ValueError(f"hidden has no positions: shape {hidden.shape}")

    if _is_python_number(temperature):
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        sample = temperature > 0
    else:
        temperature = jnp.asarray(temperature)
        if temperature.shape != () or not jnp.issubdtype(temperature.dtype, jnp.floating):
            raise ValueError(f"a traced temperature must be a float scalar, got {temperature.shape} "
                             f"{temperature.dtype}")
        sample = True  # a traced temperature selects the sampling path; it must be > 0
    inv_t = (jnp.ones((1,), jnp.float32) if not sample
             else (1.0 / jnp.asarray(temperature, jnp.float32)).reshape(1))

    draft = (jnp.full((n,), -1, jnp.int32) if draft_ids is None else _check_ids("draft_ids", draft_ids, positions))
    if sample:
        if seed is None:
            raise ValueError("sampling (temperature > 0) needs a seed")
        if jnp.shape(seed) != () or not jnp.issubdtype(jnp.asarray(seed).dtype, jnp.integer):
            raise ValueError(f"seed must be an integer scalar, got {seed!r}")
        counters = (jnp.arange(n, dtype=jnp.int32) if counters is None
                    else _check_ids("counters", counters, positions))
        keys = position_keys(seed, counters)
        exclude = (jnp.full((n,), -1, jnp.int32) if exclude_ids is None
                   else _check_ids("exclude_ids", exclude_ids, positions))
    else:
        if exclude_ids is not None or counters is not None:
            raise ValueError("exclude_ids and counters only apply when sampling (temperature > 0)")
        keys = exclude = None
    problem = _Problem(positions, n, d, vocab, weight_layout, bool(sample))
    return problem, hidden.reshape(n, d), draft, exclude, keys, inv_t


# ----------------------------------------------------------------------------------------------
# Reference: materialises the [N, V] logits.


def _reference_flat(p: _Problem, h, w, draft, exclude, keys, inv_t) -> VerifyHeadOut:
    w = w.astype(h.dtype)
    spec = "nd,dv->nv" if p.layout == "dv" else "nd,vd->nv"
    z = jnp.einsum(spec, h, w, preferred_element_type=jnp.float32) * inv_t[0]
    argmax = jnp.argmax(z, axis=-1).astype(jnp.int32)
    lse = jax.nn.logsumexp(z, axis=-1)
    in_range = (draft >= 0) & (draft < p.vocab)
    picked = jnp.take_along_axis(z, jnp.clip(draft, 0, p.vocab - 1)[:, None], axis=-1)[:, 0]
    draft_logit = jnp.where(in_range, picked, -jnp.inf)
    if p.sample:
        scores = z + gumbel_noise(keys, p.vocab)
        scores = jnp.where(jnp.arange(p.vocab)[None, :] == exclude[:, None], -jnp.inf, scores)
        sample = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    else:
        sample = argmax
    return VerifyHeadOut(argmax, lse, draft_logit, sample)


def verify_head_reference(hidden, lm_head, draft_ids=None, *, temperature=0.0, seed=None, counters=None,
                          exclude_ids=None, weight_layout: str = "dv") -> VerifyHeadOut:
    """`verify_head` in plain jnp: materialises logits [N, V] in float32 (the XLA path)."""
    p, h, draft, exclude, keys, inv_t = _prepare(hidden, lm_head, draft_ids, temperature, seed, counters,
                                                 exclude_ids, weight_layout)
    out = _reference_flat(p, h, lm_head, draft, exclude, keys, inv_t)
    return VerifyHeadOut(*(x.reshape(p.positions) for x in out))


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
        scores = z + _gumbel(_hash_bits(keys, _lane_hash(cols)))
        scores = jnp.where(cols == exclude, -jnp.inf, scores)
        g_max, g_arg = _best(scores, cols_f)
        new += [jnp.maximum(g_old, g_max), jnp.where(g_max > g_old, g_arg, gi_old)]
    return new


def _initial_state(shape, sample):
    neg = jnp.full(shape, -jnp.inf, jnp.float32)
    zero = jnp.zeros(shape, jnp.float32)
    return [neg, zero, zero, neg] + ([neg, zero] if sample else [])


def _combine(parts, n, sample) -> VerifyHeadOut:
    """Merges per-split partials [S, Np] (splits in vocab order) into per-position results [n]."""
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
    return VerifyHeadOut(argmax, lse, draft_logit, sample_ids)


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
    dims = (((1,), (0,)), ((), ())) if layout == "dv" else (((1,), (1,)), ((), ()))
    z = lax.dot_general(h, w, dims, preferred_element_type=jnp.float32)
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


def _tpu_call(p: _Problem, h, w, ids, inv_t, *, tn, tv, splits, tiles_per_split, num_vocab_tiles,
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


def _gpu_call(p: _Problem, h, w, ids, inv_t, *, tn, tv, kd, splits, tiles_per_split, bs: BlockSizes,
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
# Entry points.


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _pallas_flat(p: _Problem, h, w, draft, exclude, keys, inv_t, variant, interpret, bs: BlockSizes):
    bs.validate(variant)
    if variant == "tpu":
        tn = min(bs.token_tile, _round_up(p.n, 16))
        tv = min(bs.vocab_tile, _round_up(p.vocab, 128))
    else:
        tn = min(bs.token_tile, max(16, _next_pow2(p.n)))
        tv = min(bs.vocab_tile, max(16, _next_pow2(p.vocab)))
    num_vocab_tiles = pl.cdiv(p.vocab, tv)
    tiles_per_split = pl.cdiv(num_vocab_tiles, min(bs.vocab_splits, num_vocab_tiles))
    splits = pl.cdiv(num_vocab_tiles, tiles_per_split)  # every split starts inside the vocab
    n_pad = _round_up(p.n, tn)
    pad = n_pad - p.n
    h = jnp.pad(h, ((0, pad), (0, 0)))
    ids = [draft] + ([exclude, keys] if p.sample else [])
    ids = [jnp.pad(x, (0, pad), constant_values=-1) for x in ids]
    if variant == "tpu":
        parts = _tpu_call(p, h, w, ids, inv_t, tn=tn, tv=tv, splits=splits, tiles_per_split=tiles_per_split,
                          num_vocab_tiles=num_vocab_tiles, bs=bs, interpret=interpret)
    else:
        kd = min(bs.d_tile, max(16, _next_pow2(p.d)))
        parts = _gpu_call(p, h, w, ids, inv_t, tn=tn, tv=tv, kd=kd, splits=splits,
                          tiles_per_split=tiles_per_split, bs=bs, interpret=interpret)
    return _combine(parts, p.n, p.sample)


def verify_head(hidden, lm_head, draft_ids=None, *, temperature=0.0, seed=None, counters=None, exclude_ids=None,
                weight_layout: str = "dv", impl: str = "auto", variant: str | None = None,
                interpret: bool | None = None, block_sizes: BlockSizes | None = None) -> VerifyHeadOut:
    """The LM head and the verify reductions without materialising logits (module docstring).

    hidden [..., D] (the target's final-norm hidden states at the verified positions);
    lm_head [D, V] (weight_layout "dv") or [V, D] ("vd"); draft_ids int [...] (None: no
    draft, draft_logit = -inf); temperature: 0 = greedy, else a Python number > 0 or a traced
    positive scalar; seed: int scalar (required when sampling); counters int [...] (default
    0 .. N-1 in row-major order): one per position, distinct across positions and steps;
    exclude_ids int [...] (-1 = none): the id each position's sample must avoid.
    impl/variant/interpret: see `pallas_kernels.common.choose_kernel`; block_sizes: None =
    `BlockSizes.for_variant(variant)`. Returns VerifyHeadOut with fields shaped [...].
    """
    choice = choose_kernel(impl, variant, interpret)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    p, h, draft, exclude, keys, inv_t = _prepare(hidden, lm_head, draft_ids, temperature, seed, counters,
                                                 exclude_ids, weight_layout)
    if not choice.use_pallas:
        out = _reference_flat(p, h, lm_head, draft, exclude, keys, inv_t)
    else:
        bs = block_sizes or BlockSizes.for_variant(choice.variant)
        out = _pallas_flat(p, h, lm_head, draft, exclude, keys, inv_t, choice.variant, choice.interpret, bs)
    return VerifyHeadOut(*(x.reshape(p.positions) for x in out))


def verify_head_ids(drafts, verify_len):
    """The per-position inputs for a drafted block: drafts int [B, Bs-1], verify_len int [B] ->
    (draft_ids [B, Bs]: position i verifies d_{i+1}, -1 at the last position;
     exclude_ids [B, Bs]: d_{i+1} where a rejection at i is possible (i < verify_len - 1), else -1)."""
    drafts = jnp.asarray(drafts, jnp.int32)
    b, n = drafts.shape
    draft_ids = jnp.concatenate([drafts, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    verified = jnp.arange(n + 1)[None, :] < (jnp.asarray(verify_len)[:, None] - 1)
    return draft_ids, jnp.where(verified, draft_ids, -1)


def accept_from_head(head: VerifyHeadOut, drafts, verify_len, *, greedy: bool, keys=None):
    """Acceptance from the head's outputs (fields [B, Bs]) -> (accepted int [B], next token int [B]).

    greedy: the argmax-match rule of `acceptance.greedy_accept_ids`. Otherwise (argmax drafts,
    q one-hot) the lossless rule: accept d_{i+1} iff u_i < p_i(d_{i+1}) = exp(draft_logit_i -
    lse_i) with u_i = acceptance_uniforms(keys)[:, i] (keys int32 [B, Bs], the same position keys
    the head sampled with); the next token is head.sample at the accepted length, which the head
    drew from p with d_{i+1} excluded where a rejection was possible (see `verify_head_ids`).
    """
    drafts = jnp.asarray(drafts, jnp.int32)
    verify_len = jnp.asarray(verify_len, jnp.int32)
    b, n = drafts.shape
    if head.argmax.shape != (b, n + 1):
        raise ValueError(f"head fields must be [B, Bs] = {(b, n + 1)} for drafts {drafts.shape}, "
                         f"got {head.argmax.shape}")
    if verify_len.shape != (b,):
        raise ValueError(f"verify_len must be [B] = {(b,)}, got {verify_len.shape}")
    if greedy:
        return greedy_accept_ids(drafts, head.argmax, verify_len)
    if keys is None:
        raise ValueError("sampled acceptance needs the position keys")
    keys = jnp.asarray(keys, jnp.int32)
    if keys.shape != (b, n + 1):
        raise ValueError(f"keys must be [B, Bs] = {(b, n + 1)}, got {keys.shape}")
    p_draft = jnp.exp(head.draft_logit[:, :-1] - head.lse[:, :-1])
    u = acceptance_uniforms(keys[:, :-1])
    ok = (u < p_draft) & (jnp.arange(n)[None, :] < (verify_len[:, None] - 1))
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
    return accepted, jnp.take_along_axis(head.sample, accepted[:, None], axis=1)[:, 0]


def fused_verify(hidden, lm_head, drafts, verify_len, *, temperature=0.0, seed=None, counters=None,
                 weight_layout: str = "dv", impl: str = "auto", variant: str | None = None,
                 interpret: bool | None = None, block_sizes: BlockSizes | None = None):
    """Verification of drafted blocks straight from the target's hidden states.

    hidden [B, Bs, D] at the verified block [bonus, d_1 .. d_{Bs-1}]; drafts int [B, Bs-1];
    verify_len int [B] (1 .. Bs); counters int [B, Bs] (sampling; default b * Bs + i): one per
    (row, position), fresh every step unless the seed changes. Returns (accepted [B], next
    token [B]) by the rules of `adaflash_jax.decoding.acceptance` (greedy: identical to
    greedy_accept_ids; T > 0: the lossless rule for argmax drafts, see `accept_from_head`).
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, Bs, D], got {hidden.shape}")
    b, bs_len, _ = hidden.shape
    drafts = jnp.asarray(drafts)
    if drafts.shape != (b, bs_len - 1):
        raise ValueError(f"drafts must be [B, Bs-1] = {(b, bs_len - 1)}, got {drafts.shape}")
    draft_ids, exclude_ids = verify_head_ids(drafts, verify_len)
    greedy = _is_python_number(temperature) and temperature == 0
    if greedy:
        head = verify_head(hidden, lm_head, draft_ids, weight_layout=weight_layout, impl=impl, variant=variant,
                           interpret=interpret, block_sizes=block_sizes)
        return accept_from_head(head, drafts, verify_len, greedy=True)
    if counters is None:
        counters = jnp.arange(b * bs_len, dtype=jnp.int32).reshape(b, bs_len)
    head = verify_head(hidden, lm_head, draft_ids, temperature=temperature, seed=seed, counters=counters,
                       exclude_ids=exclude_ids, weight_layout=weight_layout, impl=impl, variant=variant,
                       interpret=interpret, block_sizes=block_sizes)
    keys = position_keys(seed, jnp.asarray(counters, jnp.int32))
    return accept_from_head(head, drafts, verify_len, greedy=False, keys=keys)

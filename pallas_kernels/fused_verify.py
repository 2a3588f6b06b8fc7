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
  with 32-bit integer ops in the kernel (`pallas_kernels.counter_hash`), so the
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
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._fused_verify_kernels import pallas_verify_head
from pallas_kernels.common import choose_kernel, unknown_variant
from pallas_kernels.counter_hash import ACCEPT_LANE, acceptance_uniforms, gumbel_noise, position_keys
from pallas_kernels.head_acceptance import accept_from_head, verify_head_ids
from pallas_kernels.tiling import check_positive_ints, is_triton_tile

__all__ = ["ACCEPT_LANE", "WEIGHT_LAYOUTS", "BlockSizes", "VerifyHeadOut", "accept_from_head", "acceptance_uniforms",
           "fused_verify", "gumbel_noise", "position_keys", "verify_head", "verify_head_ids", "verify_head_reference"]

WEIGHT_LAYOUTS = ("dv", "vd")
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_VOCAB = 1 << 24


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
        check_positive_ints(self, ("token_tile", "vocab_tile", "vocab_splits", "d_tile", "num_warps", "num_stages",
                                   "vmem_limit_bytes"), optional=("num_warps", "num_stages", "vmem_limit_bytes"))

    @classmethod
    def for_variant(cls, variant: str) -> BlockSizes:
        if variant == "tpu":
            return cls(token_tile=256, vocab_tile=512, vocab_splits=2)
        if variant == "gpu":
            return cls(token_tile=32, vocab_tile=128, vocab_splits=64, d_tile=64, num_warps=4, num_stages=2)
        raise unknown_variant(variant)

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
                if not is_triton_tile(value):
                    raise ValueError(f"GPU {name} must be a power of two >= 16, got {value}")
        else:
            raise unknown_variant(variant)


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
# Entry points.


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
        out = pallas_verify_head(p, h, lm_head, draft, exclude, keys, inv_t, choice.variant, choice.interpret, bs)
    return VerifyHeadOut(*(x.reshape(p.positions) for x in out))


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

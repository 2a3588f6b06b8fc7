"""Fused verification head: the target's LM head and the verify reductions in one pass over the vocab.

Returns per position the argmax, log-sum-exp, draft logit and a Gumbel-max
sample without writing the [N, V] logits to HBM; the acceptance rule built on
these numbers lives in `adaflash_jax.decoding.verify_head`. Design, variants
and costs: pallas_kernels/README.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._fused_verify_kernels import pallas_verify_head
from pallas_kernels._fused_verify_types import WEIGHT_LAYOUTS, BlockSizes, Problem, VerifyHeadOut
from pallas_kernels.common import choose_kernel
from pallas_kernels.counter_hash import ACCEPT_LANE, acceptance_uniforms, gumbel_noise, position_keys

__all__ = ["ACCEPT_LANE", "WEIGHT_LAYOUTS", "BlockSizes", "VerifyHeadOut", "acceptance_uniforms", "gumbel_noise",
           "is_python_number", "position_keys", "verify_head", "verify_head_reference"]

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_VOCAB = 1 << 24


# ----------------------------------------------------------------------------------------------
# Argument checks shared by the kernel and the reference.


def is_python_number(x) -> bool:
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

    if is_python_number(temperature):
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
    problem = Problem(positions, n, d, vocab, weight_layout, bool(sample))
    return problem, hidden.reshape(n, d), draft, exclude, keys, inv_t


# ----------------------------------------------------------------------------------------------
# Reference: materialises the [N, V] logits.


def _reference_flat(p: Problem, h, w, draft, exclude, keys, inv_t) -> VerifyHeadOut:
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
    """The LM head and the verify reductions without materialising logits (README.md).

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

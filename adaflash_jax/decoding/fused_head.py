"""Sampled verification through the fused verify head (`pallas_kernels.fused_verify`).

At T > 0 the XLA path turns the verified hidden states into [B, Bs, V]
log-probabilities and samples with `jax.random` keys. The fused head instead
tiles the LM head over the vocabulary and returns, per position, the
log-sum-exp, the draft token's logit and a Gumbel-max sample that avoids the
draft token where a rejection is possible; acceptance then needs only those
numbers (`accept_from_head`: the same lossless rule for argmax drafts). Its
randomness is a counter-based hash of (seed, counter), so the Pallas kernel and
its XLA reference draw identical tokens: a run is reproducible across
backends. Counters are unique per (row, output index, block position), so no
two draws in one generate call share noise.

Top-p is not supported here (the nucleus needs the sorted distribution), and
drafts must be argmax drafts (q one-hot): `generate` checks both.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.fused_verify import accept_from_head, position_keys, verify_head_ids


class HeadInputs(NamedTuple):
    """Per block position [B, Bs]: the draft it verifies, the id its sample must avoid, its
    counter; plus the int32 seed of the whole call."""

    draft_ids: jax.Array
    exclude_ids: jax.Array
    counters: jax.Array
    seed: jax.Array


def head_seed(seed_key: jax.Array) -> jax.Array:
    """An int32 seed for the counter-based hash, derived from the call's PRNG key."""
    return jax.lax.bitcast_convert_type(jax.random.bits(seed_key, (), jnp.uint32), jnp.int32)


def head_inputs(drafts: jax.Array, verify_len: jax.Array, num_out: jax.Array, seed: jax.Array,
                row_stride: int) -> HeadInputs:
    """Inputs for verifying `[bonus, drafts]` when each row has emitted num_out tokens.

    counter = (row · row_stride + num_out) · Bs + position: num_out grows every step a row
    is live and stays below row_stride, so counters never repeat within a call.
    """
    b, bs = drafts.shape[0], drafts.shape[1] + 1
    draft_ids, exclude_ids = verify_head_ids(drafts, verify_len)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    counters = (rows * row_stride + num_out[:, None]) * bs + jnp.arange(bs, dtype=jnp.int32)[None]
    return HeadInputs(draft_ids, exclude_ids, counters, seed)


def sample_head(target, hidden: jax.Array, inputs: HeadInputs, temperature, attn_impl: str):
    """The fused head's outputs for hidden [..., D] at the positions `inputs` describe (same
    leading shape): VerifyHeadOut with fields [...]."""
    return target.verify_head(hidden, inputs.draft_ids, temperature=temperature, seed=inputs.seed,
                              counters=inputs.counters, exclude_ids=inputs.exclude_ids,
                              attn_impl=attn_impl)


def accept(head_out, drafts: jax.Array, verify_len: jax.Array, inputs: HeadInputs):
    """(accepted [B], next token [B]) from the head's outputs (fields [B, Bs])."""
    keys = position_keys(inputs.seed, inputs.counters)
    return accept_from_head(head_out, drafts, verify_len, greedy=False, keys=keys)

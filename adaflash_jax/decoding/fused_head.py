"""Sampled verification through the fused verify head (`pallas_kernels.fused_verify`).

At T > 0 the XLA path turns the verified hidden states into [B, Bs, V]
log-probabilities and samples with `jax.random` keys. The fused head instead
tiles the LM head over the vocabulary and returns, per position, the
log-sum-exp, the draft token's logit and a Gumbel-max sample that avoids the
draft token where a rejection is possible; acceptance then needs only those
numbers (`accept_from_head`: the same lossless rule for argmax drafts). Its
randomness is a counter-based hash of (seed, counter), so the Pallas kernel and
its XLA reference draw identical tokens: a run is reproducible across
backends. Counters are unique per (request stream, output index, block position), so no
two draws of one seed share noise; each row's seed is folded into its counters.

Top-p is not supported here (the nucleus needs the sorted distribution), and
drafts must be argmax drafts (q one-hot): `generate` checks both.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.counter_hash import seed_mix
from pallas_kernels.fused_verify import accept_from_head, position_keys, verify_head_ids


class HeadInputs(NamedTuple):
    """Per block position [B, Bs]: the draft it verifies, the id its sample must avoid, its
    counter and the row's 1 / temperature; plus the kernel's int32 seed (rows carry their
    own seeds inside the counters, see `head_inputs`)."""

    draft_ids: jax.Array
    exclude_ids: jax.Array
    counters: jax.Array
    inv_temperature: jax.Array
    seed: jax.Array


def head_seed(seed_keys: jax.Array) -> jax.Array:
    """int32 hash seeds derived from PRNG keys (elementwise over a key array)."""
    bits = jax.vmap(lambda k: jax.random.bits(k, (), jnp.uint32))(jnp.ravel(seed_keys))
    return jax.lax.bitcast_convert_type(bits, jnp.int32).reshape(jnp.shape(seed_keys))


def head_inputs(drafts: jax.Array, verify_len: jax.Array, num_out: jax.Array, streams: jax.Array,
                seeds: jax.Array, temperature: jax.Array, row_stride: int) -> HeadInputs:
    """Inputs for verifying `[bonus, drafts]` when each row has emitted num_out tokens.

    Per row: streams int [B] (the request's stream under its seed), seeds int32 [B]
    (`head_seed` of the request's key), temperature float [B]. counter = (stream ·
    row_stride + num_out) · Bs + position: num_out grows every step a row is live and
    stays below row_stride, so a request's counters never repeat; the row's seed enters
    through the counter (`counter_hash.seed_mix`), so the slot a request sits in never
    changes its draws. Temperature is applied to the hidden states (logits are linear in
    them), which lets rows differ in temperature under the kernel's one scalar.
    """
    b, bs = drafts.shape[0], drafts.shape[1] + 1
    draft_ids, exclude_ids = verify_head_ids(drafts, verify_len)
    counters = (streams[:, None] * row_stride + num_out[:, None]) * bs + jnp.arange(bs, dtype=jnp.int32)[None]
    counters = counters ^ (seed_mix(seeds) ^ seed_mix(jnp.int32(0)))[:, None]
    inv_t = jnp.broadcast_to((1.0 / temperature.astype(jnp.float32))[:, None], (b, bs))
    return HeadInputs(draft_ids, exclude_ids, counters, inv_t, jnp.int32(0))


def sample_head(target, hidden: jax.Array, inputs: HeadInputs, attn_impl: str):
    """The fused head's outputs for hidden [..., D] at the positions `inputs` describe (same
    leading shape): VerifyHeadOut with fields [...]."""
    return target.verify_head(hidden * inputs.inv_temperature[..., None], inputs.draft_ids,
                              temperature=1.0, seed=inputs.seed, counters=inputs.counters,
                              exclude_ids=inputs.exclude_ids, attn_impl=attn_impl)


def accept(head_out, drafts: jax.Array, verify_len: jax.Array, inputs: HeadInputs):
    """(accepted [B], next token [B]) from the head's outputs (fields [B, Bs])."""
    keys = position_keys(inputs.seed, inputs.counters)
    return accept_from_head(head_out, drafts, verify_len, greedy=False, keys=keys)

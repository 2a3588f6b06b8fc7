"""Verification through the fused verify head (`pallas_kernels.fused_verify.verify_head`).

At T > 0 the XLA path turns the verified hidden states into [B, Bs, V]
log-probabilities and samples with `jax.random` keys. The verify head instead
tiles the LM head over the vocabulary and returns, per position, the
log-sum-exp, the draft token's logit and a Gumbel-max sample that avoids the
draft token where a rejection is possible; acceptance then needs only those
numbers. Its randomness is a counter-based hash of (seed, counter), so the
Pallas kernel and its XLA reference draw identical tokens: a run is reproducible
across backends. The engine samples every position from the full distribution
and accepts on match (`verify_head_accept`, lossless for argmax drafts, see
`acceptance.match_accept`) with one counter per (request stream, output
position): the token at an output position is the same draw however many tokens
the step verified. Each row's seed is folded into its counters.
`accept_from_head` is the kernel-level rule (a uniform per position, the draft
excluded from the sample where a rejection is possible) for `fused_verify`.

The acceptance rule lives here, not beside the kernel: the kernel computes
numbers, the decoding package decides what they accept.

Top-p is not supported here (the nucleus needs the sorted distribution), and
drafts must be argmax drafts (q one-hot): `generate` checks both.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from adaflash_jax.decoding.acceptance import greedy_accept_ids
from pallas_kernels.counter_hash import acceptance_uniforms, position_keys, seed_mix
from pallas_kernels.fused_verify import VerifyHeadOut, is_python_number, verify_head


class VerifyHeadInputs(NamedTuple):
    """Per block position [B, Bs]: the draft it verifies, the id its sample must avoid, its
    counter and the row's 1 / temperature; plus the kernel's int32 seed (rows carry their
    own seeds inside the counters, see `verify_head_inputs`)."""

    draft_ids: jax.Array
    exclude_ids: jax.Array
    counters: jax.Array
    inv_temperature: jax.Array
    seed: jax.Array


def verify_head_seed(seed_keys: jax.Array) -> jax.Array:
    """int32 hash seeds derived from PRNG keys (elementwise over a key array)."""
    bits = jax.vmap(lambda k: jax.random.bits(k, (), jnp.uint32))(jnp.ravel(seed_keys))
    return jax.lax.bitcast_convert_type(bits, jnp.int32).reshape(jnp.shape(seed_keys))


def verify_head_inputs(drafts: jax.Array, verify_len: jax.Array, num_out: jax.Array, streams: jax.Array,
                       seeds: jax.Array, temperature: jax.Array, row_stride: int) -> VerifyHeadInputs:
    """Inputs for verifying `[bonus, drafts]` when each row has emitted num_out tokens.

    Per row: streams int [B] (the request's stream under its seed), seeds int32 [B]
    (`verify_head_seed` of the request's key), temperature float [B]. counter = stream ·
    row_stride + num_out + position: the output position the block index emits, below
    row_stride, so one request's counters name its output positions; the row's seed
    enters through the counter (`counter_hash.seed_mix`), so the slot a request sits in
    never changes its draws. Nothing is excluded from the samples (`verify_head_accept`
    accepts on match). Temperature is applied to the hidden states (logits are linear in
    them), which lets rows differ in temperature under the kernel's one scalar.
    """
    b, bs = drafts.shape[0], drafts.shape[1] + 1
    draft_ids = verify_head_ids(drafts, verify_len)[0]
    exclude_ids = jnp.full_like(draft_ids, -1)
    counters = streams[:, None] * row_stride + num_out[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
    counters = counters ^ (seed_mix(seeds) ^ seed_mix(jnp.int32(0)))[:, None]
    inv_t = jnp.broadcast_to((1.0 / temperature.astype(jnp.float32))[:, None], (b, bs))
    return VerifyHeadInputs(draft_ids, exclude_ids, counters, inv_t, jnp.int32(0))


def run_verify_head(target, hidden: jax.Array, inputs: VerifyHeadInputs, attn_impl: str):
    """The verify head's outputs for hidden [..., D] at the positions `inputs` describe (same
    leading shape): VerifyHeadOut with fields [...]."""
    return target.verify_head(hidden * inputs.inv_temperature[..., None], inputs.draft_ids,
                              temperature=1.0, seed=inputs.seed, counters=inputs.counters,
                              exclude_ids=inputs.exclude_ids, attn_impl=attn_impl)


def verify_head_accept(head_out, drafts: jax.Array, verify_len: jax.Array):
    """(accepted [B], next token [B]) from the head's outputs (fields [B, Bs]) on inputs from
    `verify_head_inputs`: drafts accepted while they equal the head's full-distribution sample
    at the previous index, then that index's sample (`acceptance.match_accept`'s rule)."""
    return greedy_accept_ids(drafts, head_out.sample, verify_len)


# ----- the acceptance rule over the head's outputs ---------------------------------------


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
                 interpret: bool | None = None, block_sizes=None):
    """Verification of drafted blocks straight from the target's hidden states.

    hidden [B, Bs, D] at the verified block [bonus, d_1 .. d_{Bs-1}]; drafts int [B, Bs-1];
    verify_len int [B] (1 .. Bs); counters int [B, Bs] (sampling; default b * Bs + i): one per
    (row, position), fresh every step unless the seed changes. Returns (accepted [B], next
    token [B]) by the rules of `decoding.acceptance` (greedy: identical to greedy_accept_ids;
    T > 0: the lossless rule for argmax drafts, see `accept_from_head`).
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, Bs, D], got {hidden.shape}")
    b, bs_len, _ = hidden.shape
    drafts = jnp.asarray(drafts)
    if drafts.shape != (b, bs_len - 1):
        raise ValueError(f"drafts must be [B, Bs-1] = {(b, bs_len - 1)}, got {drafts.shape}")
    draft_ids, exclude_ids = verify_head_ids(drafts, verify_len)
    greedy = is_python_number(temperature) and temperature == 0
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

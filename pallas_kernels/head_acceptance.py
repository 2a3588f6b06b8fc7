"""Acceptance of drafted blocks from the fused verification head's per-position outputs.

`fused_verify` runs `verify_head` over a drafted block and hands its outputs
here: `verify_head_ids` says what each position verifies and must not sample,
`accept_from_head` turns the head's numbers into (accepted, next token) by the
rules of `adaflash_jax.decoding.acceptance`. Both are re-exported from
`pallas_kernels.fused_verify`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp

from adaflash_jax.decoding.acceptance import greedy_accept_ids
from pallas_kernels.counter_hash import acceptance_uniforms

if TYPE_CHECKING:
    from pallas_kernels.fused_verify import VerifyHeadOut


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

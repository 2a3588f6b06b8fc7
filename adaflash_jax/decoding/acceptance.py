"""Acceptance rules for verifying a drafted block (greedy and lossless sampling).

Layout: the target verified `[bonus, d_1 .. d_{Bs-1}]`; its distribution at
verify index i, p_i, is the target's distribution for the token after index
i, so draft d_{i+1} is checked against p_i. Only the first `verify_len` tokens
count: at most verify_len - 1 drafts can be accepted.

Sampling uses the standard rule: accept d with probability min(1, p(d)/q(d));
at the first rejection draw from norm(max(0, p - q)); if every verified draft
is accepted draw the next token from p. With argmax drafts q is one-hot, and
this equals "sample from p, accept on match", which `match_accept` runs with
one key per OUTPUT position: the token emitted at position n is then the draw of
key n from the target's distribution there, exactly what an AR step draws, so a
seeded result does not depend on how many tokens each step verified (which the
"auto" policy decides from the whole batch and from earlier calls).

Sampled drafts (`sample_accept` with draft_probs) cannot have that property: a
token the drafter proposed is accepted with probability min(1, p/q), so whether
position n came from a draft or from a direct draw changes which token a given key
yields; only the distribution is the same (tests check it per policy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding.sampling import NONFINITE_TOKEN


def _leading_true(flags: jax.Array) -> jax.Array:
    """Length of the all-True prefix of each row of bool [B, N]."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=-1), axis=-1)


def _verified(num_drafts: int, verify_len: jax.Array) -> jax.Array:
    return jnp.arange(num_drafts)[None, :] < (verify_len[:, None] - 1)


def greedy_accept(drafts: jax.Array, target_logits: jax.Array, verify_len: jax.Array):
    """drafts int [B, Bs-1], target_logits [B, Bs, V] -> (accepted [B], next token [B])."""
    return greedy_accept_ids(drafts, jnp.argmax(target_logits, axis=-1).astype(jnp.int32), verify_len)


def greedy_accept_ids(drafts: jax.Array, best: jax.Array, verify_len: jax.Array):
    """greedy_accept from the target's argmax ids best int [B, Bs] (computed where the logits
    live, e.g. in the packed buffer) -> (accepted [B], next token [B])."""
    match = (drafts == best[:, :-1]) & _verified(drafts.shape[1], verify_len)
    accepted = _leading_true(match)
    return accepted, jnp.take_along_axis(best, accepted[:, None], axis=1)[:, 0]


def stop_at_nonfinite(accepted: jax.Array, nxt: jax.Array, finite: jax.Array):
    """(accepted [B], next token [B]) of sampled verification cut at the row's first position
    whose target logits were not finite (finite bool [B, W], by the index each emitted token
    comes from: a chain's verify index, a tree path's depth). The drafts before it stand and
    the token there is NONFINITE_TOKEN, which `engine_state.commit` ends the request with, as
    greedy verification does through the -1 argmax (sampling draws from the log-probs, so a
    row of NaN would otherwise emit arbitrary tokens)."""
    accepted = jnp.minimum(accepted, _leading_true(finite))
    ok = jnp.take_along_axis(finite, accepted[:, None], axis=1)[:, 0]
    return accepted, jnp.where(ok, nxt, NONFINITE_TOKEN)


def lazy_chunks(block: int) -> tuple[int, ...]:
    """Index chunks the lazy greedy head scores in turn: 1, then 3, then the rest. The first is
    a matrix-vector product (a third of the 16-row head on a CPU) and most steps stop there."""
    sizes, left = [], block
    for size in (1, 3, block):
        if left > 0:
            sizes.append(min(size, left))
            left -= sizes[-1]
    return tuple(sizes)


def lazy_greedy_ids(argmax_fn, hidden: jax.Array, drafts: jax.Array, verify_len: jax.Array) -> jax.Array:
    """The target's argmax ids [B, Bs] for verified hidden states [B, Bs, D], scored chunk by
    chunk (`lazy_chunks`) only while some row has accepted every draft so far. Unscored indices
    hold -1: no draft equals it, and `greedy_accept_ids` never reads past the first mismatch, so
    the result is `greedy_accept_ids`' own. argmax_fn: hidden [B, T, D] -> int32 [B, T]."""
    b, bs = hidden.shape[:2]
    best = jnp.full((b, bs), -1, jnp.int32)
    verified = _verified(bs - 1, verify_len)
    start = 0
    for size in lazy_chunks(bs):
        def score(best, start=start, size=size):
            return jax.lax.dynamic_update_slice_in_dim(best, argmax_fn(hidden[:, start:start + size]), start, 1)
        if start == 0:
            best = score(best)
        else:  # a row needs index `start` iff its drafts 1..start were all verified and matched
            reaches = jnp.all((drafts[:, :start] == best[:, :start]) & verified[:, :start], axis=1)
            best = jax.lax.cond(jnp.any(reaches), score, lambda best: best, best)
        start += size
    return best


def match_accept(drafts: jax.Array, target_log_probs: jax.Array, verify_len: jax.Array, keys: jax.Array):
    """Lossless sampling for argmax drafts: at every verified index i draw x_i from p_i with
    keys[:, i] (keys [B, Bs]: the key of the output position index i emits), accept drafts
    while d_{i+1} == x_i, emit x at the first mismatch. -> (accepted [B], next token [B])."""
    draws = jax.vmap(jax.vmap(jax.random.categorical))(keys, target_log_probs).astype(jnp.int32)
    return greedy_accept_ids(drafts, draws, verify_len)


def residual_distribution(p: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(0, p - q)); falls back to p where p == q leaves no mass."""
    r = jnp.maximum(p - q, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def sample_accept(drafts: jax.Array, target_log_probs: jax.Array, verify_len: jax.Array,
                  keys: jax.Array, draft_probs: jax.Array | None = None):
    """Lossless speculative sampling.

    drafts int [B, Bs-1]; target_log_probs [B, Bs, V] (after temperature/top-p);
    keys: one PRNG key per row; draft_probs [B, Bs-1, V] for sampled drafts, or
    None for argmax drafts (q one-hot). Returns (accepted [B], next token [B]).
    """
    b, n = drafts.shape
    p = jnp.exp(target_log_probs)
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    accept_keys, sample_keys = jax.vmap(lambda k: jax.random.split(k, 2))(keys).swapaxes(0, 1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(accept_keys)
    accepted = _leading_true((u * q_draft < p_draft) & _verified(n, verify_len))

    p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    if draft_probs is None:
        q_at = jax.nn.one_hot(jnp.take_along_axis(
            drafts, jnp.minimum(accepted, n - 1)[:, None], axis=1)[:, 0], p.shape[-1], dtype=p.dtype)
    else:
        q_at = jnp.take_along_axis(draft_probs, jnp.minimum(accepted, n - 1)[:, None, None], axis=1)[:, 0]
    rejected = accepted < verify_len - 1
    dist = jnp.where(rejected[:, None], residual_distribution(p_at, q_at), p_at)
    logits = jnp.log(jnp.maximum(dist, 0.0))
    nxt = jax.vmap(jax.random.categorical)(sample_keys, logits).astype(jnp.int32)
    return accepted, nxt

"""The batched speculative engine: draft -> verify -> accept -> commit/rollback.

One jitted `lax.while_loop` over verify steps. Per row it keeps the target KV
cache (committed length L = tokens whose K/V are valid), the drafter's
context cache (features of the same L positions) and the bonus token (the
last committed token, at position L, not yet run through the target).
A step drafts `[bonus, MASK..]`, verifies `[bonus, d_1..d_{Bs-1}]` in one
target forward (only the first `verify_len` count), commits a+1 tokens and
rolls both caches back to L + a + 1 by setting their lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.decoding import acceptance
from adaflash_jax.decoding.autoregressive import is_stop, new_cache, prefill
from adaflash_jax.decoding.sampling import sample_next, target_log_probs, token_keys
from adaflash_jax.models.drafter import append_context, draft_block, new_context_cache


def propose(target, drafter, anchors, ctx_cache, *, greedy, temperature, top_p, keys,
            sample_drafts: bool, attn_impl: str):
    """Draft tokens [B, Bs-1] and, for sampled drafts, their distributions q."""
    hidden = draft_block(drafter, target.embed_tokens, anchors, ctx_cache, attn_impl=attn_impl)
    logits = target.logits(hidden)
    if greedy or not sample_drafts:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    logq = target_log_probs(logits, temperature, top_p)
    drafts = jax.vmap(lambda k, lq: jax.random.categorical(k, lq, axis=-1))(keys, logq)
    return drafts.astype(jnp.int32), jnp.exp(logq)


def emitted_tokens(drafts, accepted, nxt):
    """[B, Bs]: accepted drafts, then the target's token at index `accepted`."""
    bs = drafts.shape[1] + 1
    idx = jnp.arange(bs)[None]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return jnp.where(idx < accepted[:, None], padded, jnp.where(idx == accepted[:, None], nxt[:, None], 0))


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "max_new_cap",
                                             "cache_len", "greedy", "sample_drafts", "attn_impl"))
def speculative_padded(target_def, drafter_def, tstate, dstate, tokens, lengths, active, max_new,
                       verify_len, seed_key, temperature, top_p, eos_ids, *, max_new_cap: int,
                       cache_len: int, greedy: bool, sample_drafts: bool = False,
                       attn_impl: str = "xla"):
    """Speculative generation on a padded batch.

    verify_len: int [B] tokens verified per step (1..block_size). Returns
    (out [B, cap + Bs], num_out [B], steps, commits [B, cap]: tokens committed
    per verify step, 0 where the row was already done).
    """
    target = nnx.merge(target_def, tstate)
    drafter = nnx.merge(drafter_def, dstate)
    layer_ids = drafter.cfg.target_layer_ids
    b, t = tokens.shape
    bs = drafter.cfg.block_size
    rows = jnp.arange(b, dtype=jnp.int32)

    logits, pre, tcache = prefill(target, tokens, lengths, new_cache(target, b, cache_len),
                                  feature_layers=layer_ids, attn_impl=attn_impl)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    ctx = append_context(drafter, new_context_cache(drafter, b, cache_len), pre.features, positions)
    ctx = ctx.with_lengths(lengths)
    first = sample_next(logits, token_keys(seed_key, rows, 0), greedy, temperature, top_p)
    out = jnp.zeros((b, max_new_cap + bs), jnp.int32).at[:, 0].set(first)
    num_out = active.astype(jnp.int32)
    done = ~active | is_stop(first, eos_ids) | (num_out >= max_new)
    commits = jnp.zeros((b, max_new_cap), jnp.int32)

    def cond(c):
        return (c["step"] < max_new) & ~jnp.all(c["done"])

    def body(c):
        tcache, ctx, bonus, num_out, done = c["tcache"], c["ctx"], c["bonus"], c["num_out"], c["done"]
        step_keys = token_keys(seed_key, rows, num_out)
        draft_keys, accept_keys = jax.vmap(lambda k: jax.random.split(k, 2))(step_keys).swapaxes(0, 1)
        drafts, q = propose(target, drafter, bonus, ctx, greedy=greedy, temperature=temperature,
                            top_p=top_p, keys=draft_keys, sample_drafts=sample_drafts,
                            attn_impl=attn_impl)
        verify = target(jnp.concatenate([bonus[:, None], drafts], axis=1), cache=tcache,
                        feature_layers=layer_ids, attn_impl=attn_impl)
        vlogits = target.logits(verify.hidden)
        if greedy:
            accepted, nxt = acceptance.greedy_accept(drafts, vlogits, verify_len)
        else:
            accepted, nxt = acceptance.sample_accept(
                drafts, target_log_probs(vlogits, temperature, top_p), verify_len, accept_keys, q)
        emitted = emitted_tokens(drafts, accepted, nxt)
        idx = jnp.arange(bs)[None]
        stops = is_stop(emitted, eos_ids) & (idx <= accepted[:, None])
        n_emit = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1, accepted + 1)
        n_emit = jnp.where(done, 0, jnp.minimum(n_emit, max_new - num_out))
        write = jnp.where(idx < n_emit[:, None], num_out[:, None] + idx, max_new_cap + bs)
        out = c["out"].at[rows[:, None], write].set(emitted, mode="drop")
        start = tcache.lengths
        new_len = start + n_emit
        ctx_pos = start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        ctx = append_context(drafter, ctx, verify.features, ctx_pos).with_lengths(new_len)
        last = jnp.take_along_axis(emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
        num_out = num_out + n_emit
        done = done | jnp.any(stops & (idx < n_emit[:, None]), axis=1) | (num_out >= max_new)
        return dict(tcache=verify.cache.with_lengths(new_len), ctx=ctx,
                    bonus=jnp.where(n_emit > 0, last, bonus), out=out, num_out=num_out, done=done,
                    commits=c["commits"].at[:, c["step"]].set(n_emit), step=c["step"] + 1)

    carry = dict(tcache=tcache, ctx=ctx, bonus=first, out=out, num_out=num_out, done=done,
                 commits=commits, step=jnp.int32(0))
    final = jax.lax.while_loop(cond, body, carry)
    return final["out"], final["num_out"], final["step"], final["commits"]

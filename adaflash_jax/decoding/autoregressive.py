"""Batched autoregressive decoding: one jitted prefill + `lax.while_loop` decode.

Per-sequence state (committed length, tokens emitted, done flag) lives in the
loop carry, so prompts of different lengths decode together exactly as each
would alone. The speculative engine reuses `prefill` and the stop rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.decoding.sampling import sample_next, token_keys
from adaflash_jax.models.kv_cache import KVCache
from adaflash_jax.models.target import ForwardOutput, TargetLM


def new_cache(model: TargetLM, batch: int, cache_len: int) -> KVCache:
    cfg = model.cfg
    return KVCache.create(cfg.num_layers, batch, cfg.num_kv_heads, cache_len, cfg.head_dim,
                          cfg.compute_dtype)


def prefill(model: TargetLM, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
            feature_layers=(), attn_impl: str = "xla") -> tuple[jax.Array, ForwardOutput, KVCache]:
    """Runs right-padded prompts; returns last-prompt-token logits [B, V], the
    forward output, and the cache committed to the prompt lengths."""
    out = model(tokens, cache=cache.with_lengths(jnp.zeros_like(lengths)),
                feature_layers=feature_layers, attn_impl=attn_impl)
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(last), out, out.cache.with_lengths(lengths)


def is_stop(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """True where a token is one of the stop ids (eos_ids: int [E], may be empty)."""
    if eos_ids.shape[0] == 0:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_cap", "cache_len", "greedy",
                                             "attn_impl"))
def generate_padded(graphdef, state, tokens, lengths, active, max_new, seed_key, temperature,
                    top_p, eos_ids, *, max_new_cap: int, cache_len: int, greedy: bool,
                    attn_impl: str = "xla"):
    """AR generation on a padded batch. Returns (out_tokens [B, cap], num_out [B], steps)."""
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    rows = jnp.arange(b, dtype=jnp.int32)
    logits, _, cache = prefill(model, tokens, lengths, new_cache(model, b, cache_len),
                               attn_impl=attn_impl)
    first = sample_next(logits, token_keys(seed_key, rows, 0), greedy, temperature, top_p)
    out = jnp.zeros((b, max_new_cap), jnp.int32).at[:, 0].set(first)
    num_out = active.astype(jnp.int32)
    done = ~active | is_stop(first, eos_ids) | (num_out >= max_new)

    def cond(carry):
        _, _, _, done, _, step = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        cache, last, out, done, num_out, step = carry
        res = model(last[:, None], cache=cache, attn_impl=attn_impl)
        logits = model.logits(res.hidden[:, 0])
        tok = sample_next(logits, token_keys(seed_key, rows, num_out), greedy, temperature, top_p)
        live = ~done
        out = jnp.where(live[:, None] & (jnp.arange(max_new_cap)[None] == num_out[:, None]),
                        tok[:, None], out)
        num_out = num_out + live
        cache = res.cache.with_lengths(cache.lengths + live)
        done = done | (live & is_stop(tok, eos_ids)) | (num_out >= max_new)
        return cache, jnp.where(live, tok, last), out, done, num_out, step + 1

    carry = (cache, first, out, done, num_out, jnp.int32(1))
    _, _, out, _, num_out, steps = jax.lax.while_loop(cond, body, carry)
    return out, num_out, steps

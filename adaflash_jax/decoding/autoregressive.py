"""Autoregressive pieces of the engine: the target's KV cache, prompt prefill, the AR step.

The engine (`engine.py`) prefills prompts into slots with `prefill` and, without
a drafter, advances every live slot one token per `ar_step`; per-slot lengths
let prompts of different lengths decode together exactly as each would alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding.engine_state import DecodeState, commit
from adaflash_jax.decoding.sampling import sample_next, stream_keys
from adaflash_jax.models.kv_cache import KVCache
from adaflash_jax.models.target import ForwardOutput, TargetLM


def new_cache(model: TargetLM, batch: int, cache_len: int) -> KVCache:
    """An empty target KV cache in the model's layer layout (stacked or per layer)."""
    cfg = model.cfg
    return KVCache.create(cfg.num_layers, batch, cfg.num_kv_heads, cache_len, cfg.head_dim,
                          cfg.compute_dtype, per_layer=model.layers.per_layer)


def prefill(model: TargetLM, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
            feature_layers=(), attn_impl: str = "xla") -> tuple[jax.Array, ForwardOutput, KVCache]:
    """Runs right-padded prompts; returns last-prompt-token logits [B, V], the
    forward output, and the cache committed to the prompt lengths."""
    out = model(tokens, cache=cache.with_lengths(jnp.zeros_like(lengths)),
                feature_layers=feature_layers, attn_impl=attn_impl, empty_cache=True)
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(last), out, out.cache.with_lengths(lengths)


def ar_step(cfg, target: TargetLM, state: DecodeState) -> DecodeState:
    """One plain decode step for every live slot: each runs its bonus token and commits the
    token the target picks after it (`cfg`: an `engine_state.EngineConfig`)."""
    p = state.params
    res = target(state.bonus[:, None], cache=state.tcache, attn_impl=cfg.attn_impl)
    logits = target.logits(res.hidden[:, 0])
    tok = sample_next(logits, stream_keys(p.seed_key, p.stream, state.num_out), cfg.greedy,
                      p.temperature[:, None], p.top_p[:, None])
    ones = jnp.ones_like(state.num_out)
    return commit(state, tok[:, None], jnp.zeros_like(tok), res.cache, None, ones, False)

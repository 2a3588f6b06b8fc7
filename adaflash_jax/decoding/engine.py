"""The decode engine: pure functions of a `DecodeState` of S slots.

    init_state -> insert (prefill prompts into slots) -> step ... step -> evict

`insert` prefills prompts into chosen slots (a batch of them in one call);
`step` advances every live slot once (an AR step without a drafter, else draft
-> plan lengths -> verify -> accept -> commit); `evict` frees slots. A host
loop that inserts arrivals between steps and collects finished slots is
continuous batching; `decode_batch` (insert all, then a `while_loop` over
`step`) is what `af.generate` runs. AR, DFlash-fixed and AdaFlash all go
through the same `step`. `EngineConfig` is static; the `*_jit` versions take it
as a static argument.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.decoding.autoregressive import ar_step, new_cache, prefill
from adaflash_jax.decoding.engine_state import (DecodeOutput, DecodeState, EngineConfig, EngineWeights,
                                                PolicyState, SlotParams, cache_rows, is_stop, slot_rows)
from adaflash_jax.decoding.sampling import sample_next, stream_keys
from adaflash_jax.decoding.speculative import spec_step
from adaflash_jax.decoding.tree_step import tree_step
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState
from adaflash_jax.models.kv_cache import KVCache
from adaflash_jax.models.drafter import append_context, new_context_cache


def _models(cfg: EngineConfig, weights: EngineWeights):
    target = nnx.merge(cfg.target_def, weights.target)
    drafter = nnx.merge(cfg.drafter_def, weights.drafter) if cfg.speculative else None
    length_head = (nnx.merge(cfg.length_head_def, weights.length_head)
                   if cfg.speculative and cfg.policy != "fixed" and cfg.length_head_def is not None else None)
    return target, drafter, length_head


def init_state(cfg: EngineConfig, weights: EngineWeights, num_slots: int, eos_ids: jax.Array,
               plan: PlanParams | None = None) -> DecodeState:
    """S free slots. plan: the "head" / "auto" policy settings (None for "fixed" and AR)."""
    if (plan is None) != (not cfg.speculative or cfg.policy == "fixed"):
        need = "needs" if plan is None else "takes no"
        raise ValueError(f"length policy {cfg.policy!r} {need} PlanParams")
    target, drafter, _ = _models(cfg, weights)
    s = num_slots
    zeros = jnp.zeros((s,), jnp.int32)
    ones = jnp.ones((s,), jnp.float32)
    params = SlotParams(zeros, ones, ones, jax.random.wrap_key_data(jnp.zeros((s, 2), jnp.uint32)), zeros,
                        jnp.ones((s,), jnp.int32))
    policy = None
    if cfg.speculative and cfg.policy == "auto":
        none = jnp.zeros((s,), jnp.float32)  # no acceptance feedback yet
        policy = PolicyState(jnp.full((s,), plan.start.p, jnp.float32),
                             jnp.asarray(plan.start.since_draft, jnp.int32), jnp.asarray(plan.start.gap, jnp.int32),
                             none, none, none, jnp.asarray(plan.start.p, jnp.float32))
    return DecodeState(
        tcache=new_cache(target, s, cfg.cache_len),
        ctx=new_context_cache(drafter, s, cfg.cache_len) if cfg.speculative else None,
        bonus=zeros, out=jnp.zeros((s, cfg.out_width), jnp.int32), num_out=zeros,
        done=jnp.ones((s,), bool), params=params, eos_ids=jnp.asarray(eos_ids, jnp.int32),
        commits=jnp.zeros((s, cfg.max_new_cap), jnp.int32),
        verified=jnp.zeros((s, cfg.max_new_cap), jnp.int32),
        slot_steps=zeros, steps=jnp.int32(0), drafted_steps=jnp.int32(0), plan=plan, policy=policy,
        nonfinite=jnp.zeros((s,), bool))


def _rows_from(cache: KVCache, slots: jax.Array, starts: jax.Array) -> KVCache:
    """The cache rows of `slots` at lengths `starts`; a row starting at 0 is zeroed (as a fresh
    cache: nothing a previous request left there reaches it, not even through masked attention)."""
    return cache.rows(slots).zero_rows(starts == 0).with_lengths(starts)


def _prefill_at(cfg: EngineConfig, target, drafter, state: DecodeState, slots, tokens, lengths, starts):
    """Prompt tokens [n, T] (lengths [n] of them real) run at positions starts + t of the rows of
    `slots`. Returns the logits after each row's last real token, and the rows' target and
    drafter caches committed to starts + lengths (ctx None without a drafter)."""
    layer_ids = drafter.cfg.target_layer_ids if cfg.speculative else ()
    if starts is None:  # the whole prompt at once, into fresh rows
        n, t = tokens.shape
        logits, pre, tcache = prefill(target, tokens, lengths, new_cache(target, n, cfg.cache_len),
                                      feature_layers=layer_ids, attn_impl=cfg.attn_impl)
        fresh_ctx = new_context_cache(drafter, n, cfg.cache_len) if cfg.speculative else None
        starts = jnp.zeros_like(lengths)
    else:  # one chunk after the `starts` tokens already in the rows (`prefill_chunk`)
        pre = target(tokens, cache=_rows_from(state.tcache, slots, starts), feature_layers=layer_ids,
                     attn_impl=cfg.attn_impl)
        last = jnp.take_along_axis(pre.hidden, (jnp.maximum(lengths, 1) - 1)[:, None, None], axis=1)[:, 0]
        logits, tcache = target.logits(last), pre.cache.with_lengths(starts + lengths)
        fresh_ctx = _rows_from(state.ctx, slots, starts) if cfg.speculative else None
    ctx = None
    if cfg.speculative:
        positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        ctx = append_context(drafter, fresh_ctx, pre.features, positions).with_lengths(starts + lengths)
    return logits, tcache, ctx


def prefill_chunk(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, slots: jax.Array,
                  tokens: jax.Array, lengths: jax.Array, starts: jax.Array) -> DecodeState:
    """Writes a non-final chunk of prompts into `slots` (chunked prefill): tokens [n, C], lengths
    of them real, at positions starts + t (starts 0: the first chunk, into a cleared row). The
    slots stay done (no step advances them) until `insert` with `starts` adds the last chunk."""
    target, drafter, _ = _models(cfg, weights)
    _, tcache, ctx = _prefill_at(cfg, target, drafter, state, slots, tokens, lengths, starts)
    return state.replace(tcache=cache_rows(state.tcache, slots, tcache),
                         ctx=None if ctx is None else cache_rows(state.ctx, slots, ctx),
                         done=state.done.at[slots].set(True),
                         params=state.params.replace(max_new=state.params.max_new.at[slots].set(0)))


def insert(cfg: EngineConfig, weights: EngineWeights, state: DecodeState, slots: jax.Array,
           tokens: jax.Array, lengths: jax.Array, params: SlotParams, starts: jax.Array | None = None) -> DecodeState:
    """Prefills n right-padded prompts tokens [n, T] (true lengths [n]) into `slots` [n]
    (distinct), replacing whatever those slots held, and draws each request's first token.
    starts [n]: the prompts' earlier tokens are already in the slots (`prefill_chunk`), and
    `tokens` are their last chunks, at positions starts + t.

    Rows with params.max_new == 0 stay free. T plus max_new_cap must fit cache_len, plus
    the block or tree budget for the fixed speculative modes, whose steps write past the
    committed length (the host checks; `generate` buckets T to a power of two).
    """
    target, drafter, _ = _models(cfg, weights)
    n = tokens.shape[0]
    logits, tcache, ctx = _prefill_at(cfg, target, drafter, state, slots, tokens, lengths, starts)
    first = sample_next(logits, stream_keys(params.seed_key, params.stream, 0), cfg.greedy,
                        params.temperature[:, None], params.top_p[:, None])
    if cfg.speculative:
        ctx = cache_rows(state.ctx, slots, ctx)
    live = params.max_new > 0
    num_out = live.astype(jnp.int32)
    nonfinite = live & (first < 0)  # the prompt's last logits were not finite (`sample_next`)
    done = ~live | is_stop(first, state.eos_ids) | (num_out >= params.max_new) | nonfinite
    out = jnp.zeros((n, cfg.out_width), jnp.int32).at[:, 0].set(first)
    policy = state.policy
    if policy is not None:  # a new request starts from the running estimate, with no feedback
        policy = policy.reset(slots)
    zero = jnp.zeros((n,), jnp.int32)
    return state.replace(
        tcache=cache_rows(state.tcache, slots, tcache), ctx=ctx, bonus=state.bonus.at[slots].set(first),
        out=state.out.at[slots].set(out), num_out=state.num_out.at[slots].set(num_out),
        done=state.done.at[slots].set(done), params=slot_rows(state.params, slots, params),
        commits=state.commits.at[slots].set(0), verified=state.verified.at[slots].set(0),
        slot_steps=state.slot_steps.at[slots].set(zero), policy=policy,
        nonfinite=state.nonfinite.at[slots].set(nonfinite))


def step(cfg: EngineConfig, weights: EngineWeights, state: DecodeState) -> DecodeState:
    """Advances every live slot by one decode step (finished and free slots are untouched)."""
    target, drafter, length_head = _models(cfg, weights)
    if not cfg.speculative:
        return ar_step(cfg, target, state)
    if cfg.verify == "tree":
        return tree_step(cfg, target, drafter, state)
    return spec_step(cfg, target, drafter, length_head, state)


def evict(state: DecodeState, slots: jax.Array) -> DecodeState:
    """Frees `slots`: they stop decoding and hold nothing (read their output first)."""
    zero = jnp.zeros(jnp.shape(slots), jnp.int32)
    ctx = None if state.ctx is None else state.ctx.with_lengths(state.ctx.lengths.at[slots].set(zero))
    policy = None if state.policy is None else state.policy.reset(slots)
    return state.replace(
        tcache=state.tcache.with_lengths(state.tcache.lengths.at[slots].set(zero)), ctx=ctx,
        done=state.done.at[slots].set(True), num_out=state.num_out.at[slots].set(zero),
        params=state.params.replace(max_new=state.params.max_new.at[slots].set(zero)), policy=policy)


def decode(cfg: EngineConfig, weights: EngineWeights, state: DecodeState) -> DecodeState:
    """Steps until every slot is done (at most max_new_cap steps: each commits >= 1 token)."""
    limit = state.steps + cfg.max_new_cap
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.steps < limit),
                              lambda s: step(cfg, weights, s), state)


@functools.partial(jax.jit, static_argnums=0)
def decode_batch(cfg: EngineConfig, weights: EngineWeights, tokens: jax.Array, lengths: jax.Array,
                 params: SlotParams, eos_ids: jax.Array, plan: PlanParams | None = None) -> DecodeOutput:
    """Row i of tokens [B, T] in slot i, all decoded to completion (`generate`'s call)."""
    b = tokens.shape[0]
    state = init_state(cfg, weights, b, eos_ids, plan)
    state = insert(cfg, weights, state, jnp.arange(b, dtype=jnp.int32), tokens, lengths, params)
    state = decode(cfg, weights, state)
    probe = None
    if state.policy is not None:  # the mean corrected estimate over real requests, for the next
        # call; their feedback counts end with them (each new request starts its own)
        real = (params.max_new > 0).astype(jnp.float32)
        probe = ProbeState(jnp.sum(state.policy.p_est * real) / jnp.maximum(jnp.sum(real), 1.0),
                           state.policy.since_draft, state.policy.probe_gap)
    return DecodeOutput(state.out, state.num_out, state.steps, state.commits, state.verified,
                        state.drafted_steps, probe)


init_state_jit = jax.jit(init_state, static_argnums=(0, 2))
insert_jit = jax.jit(insert, static_argnums=0)
prefill_chunk_jit = jax.jit(prefill_chunk, static_argnums=0)
step_jit = jax.jit(step, static_argnums=0)
evict_jit = jax.jit(evict)

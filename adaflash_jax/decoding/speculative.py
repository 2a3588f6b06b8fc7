"""The batched speculative engine: draft -> verify -> accept -> commit/rollback.

One jitted `lax.while_loop` over verify steps. Per row it keeps the target KV
cache (committed length L = tokens whose K/V are valid), the drafter's
context cache (features of the same L positions) and the bonus token (the
last committed token, at position L, not yet run through the target).
A step drafts `[bonus, MASK..]`, verifies `[bonus, d_1..d_{Bs-1}]` in one
target forward (only the first `verify_len` count), commits a+1 tokens and
rolls both caches back to L + a + 1 by setting their lengths.

Length policies (static `policy`): "fixed" verifies each row's `verify_len`
tokens in a static [B, Bs] pass (DFlash). "head" and "auto" score every drafted
block with the AdaFlash length head and verify per-row lengths through the
packed path (`packed_verify`), so shorter verification costs fewer tokens:
"head" applies the rule `clamp(round(ŝ·Bs·ρ), Lmin, Bs)`, "auto" maximises
expected commits per second under calibrated step costs and skips drafting
altogether (a plain AR step) when drafting does not pay (`verify_plan`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.decoding import acceptance, verify_plan
from adaflash_jax.decoding import fused_head as fused
from adaflash_jax.decoding.length_policy import POLICIES
from adaflash_jax.decoding.packed_verify import verify_packed, verify_shapes
from adaflash_jax.decoding.autoregressive import is_stop, new_cache, prefill
from adaflash_jax.decoding.sampling import sample_next, target_log_probs, token_keys
from adaflash_jax.models import draft_vocab
from adaflash_jax.models.drafter import append_context, draft_block, new_context_cache


def propose(target, drafter, anchors, ctx_cache, *, greedy, temperature, top_p, keys,
            sample_drafts: bool, attn_impl: str, head=None):
    """Draft tokens [B, Bs-1], for sampled drafts their distributions q (else None), and
    the length head's scores ŝ [B] (None without a head)."""
    block_hidden = draft_block(drafter, target.embed_tokens, anchors, ctx_cache, attn_impl=attn_impl)
    scores = head(block_hidden) if head is not None else None
    if greedy or not sample_drafts:
        return draft_vocab.greedy_tokens(target, drafter, block_hidden[:, 1:], attn_impl), None, scores
    logq = draft_vocab.full_log_probs(drafter, target_log_probs(
        draft_vocab.logits(target, drafter, block_hidden[:, 1:]), temperature, top_p), target.cfg.vocab_size)
    drafts = jax.vmap(lambda k, lq: jax.random.categorical(k, lq, axis=-1))(keys, logq)
    return drafts.astype(jnp.int32), jnp.exp(logq), scores


def emitted_tokens(drafts, accepted, nxt):
    """[B, Bs]: accepted drafts, then the target's token at index `accepted`."""
    bs = drafts.shape[1] + 1
    idx = jnp.arange(bs)[None]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return jnp.where(idx < accepted[:, None], padded, jnp.where(idx == accepted[:, None], nxt[:, None], 0))


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "head_def", "max_new_cap",
                                             "cache_len", "greedy", "sample_drafts", "attn_impl",
                                             "policy", "buckets", "fused_head"))
def speculative_padded(target_def, drafter_def, tstate, dstate, tokens, lengths, active, max_new,
                       verify_len, seed_key, temperature, top_p, eos_ids, hstate=None,
                       plan: verify_plan.PlanParams | None = None, *, head_def=None, max_new_cap: int,
                       cache_len: int, greedy: bool, sample_drafts: bool = False,
                       attn_impl: str = "xla", policy: str = "fixed", buckets: tuple[int, ...] = (),
                       fused_head: bool = False):
    """Speculative generation on a padded batch.

    verify_len: int [B] tokens verified per step (1..block_size) under the "fixed"
    policy. "head" / "auto" need the length head (head_def, hstate), `plan` and the
    packed bucket sizes `buckets` (ascending, the last >= B * block_size). fused_head (T > 0,
    argmax drafts, no top-p): sampled verification through the fused verify head with
    counter-based randomness (`fused_head.py`) instead of [.., V] log-probs.
    Returns (out [B, cap + Bs], num_out [B], steps, commits [B, cap]: tokens committed
    per verify step, verified [B, cap]: tokens verified per step (0 where the row was
    done), drafted [cap]: whether the step drafted, and for "auto" the final ProbeState).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown length policy {policy!r}; choose one of {POLICIES}")
    target = nnx.merge(target_def, tstate)
    drafter = nnx.merge(drafter_def, dstate)
    head = nnx.merge(head_def, hstate) if policy != "fixed" else None
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
    sampling = dict(greedy=greedy, temperature=temperature, top_p=top_p)
    use_head = fused_head and not greedy
    seed = fused.head_seed(seed_key) if use_head else None

    def cond(c):
        return (c["step"] < max_new) & ~jnp.all(c["done"])

    def draft(c, keys):
        return propose(target, drafter, c["bonus"], c["ctx"], keys=keys, sample_drafts=sample_drafts,
                       attn_impl=attn_impl, head=head, **sampling)

    def fixed_verify(c, drafts, q, accept_keys):
        verify = target(jnp.concatenate([c["bonus"][:, None], drafts], axis=1), cache=c["tcache"],
                        feature_layers=layer_ids, attn_impl=attn_impl)
        if greedy:
            accepted, nxt = acceptance.greedy_accept_ids(
                drafts, target.greedy_tokens(verify.hidden, attn_impl), verify_len)
        elif use_head:
            inputs = fused.head_inputs(drafts, verify_len, c["num_out"], seed, max_new_cap + bs)
            head_out = fused.sample_head(target, verify.hidden, inputs, temperature, attn_impl)
            accepted, nxt = fused.accept(head_out, drafts, verify_len, inputs)
        else:
            accepted, nxt = acceptance.sample_accept(
                drafts, target_log_probs(target.logits(verify.hidden), temperature, top_p), verify_len,
                accept_keys, q)
        ctx_pos = c["tcache"].lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        ctx = append_context(drafter, c["ctx"], verify.features, ctx_pos)
        return accepted, nxt, ctx, verify.cache, verify_len

    def adaptive_step(c, draft_keys, accept_keys):
        live = ~c["done"]
        if policy == "head":
            draft_now = jnp.bool_(True)
        else:
            draft_now = (verify_plan.drafting_pays(c["p_est"], live, buckets, bs, plan.costs)
                         | (c["since_draft"] >= c["probe_gap"]))
        vocab = target.cfg.vocab_size
        skipped = (jnp.zeros((b, bs - 1), jnp.int32),
                   None if greedy or not sample_drafts else jnp.zeros((b, bs - 1, vocab), jnp.float32),
                   jnp.zeros((b,), jnp.float32))
        drafts, q, scores = jax.lax.cond(draft_now, lambda: draft(c, draft_keys), lambda: skipped)
        if policy == "head":
            lens = verify_plan.head_lengths(scores, live, bs, plan.rho, plan.min_len)
            k = verify_plan.bucket_index(jnp.sum(lens), buckets)
        else:
            p = verify_plan.per_token_acceptance(scores, bs)
            planned, k_planned, _ = verify_plan.best_allocation(p, live, buckets, bs, plan.costs)
            lens = jnp.where(draft_now, planned, live.astype(jnp.int32))
            k = jnp.where(draft_now, k_planned, -1)  # -1: the AR-step shape
            c["p_est"] = jnp.where(draft_now & live, p, c["p_est"])
            c["since_draft"] = jnp.where(draft_now, 0, c["since_draft"] + 1)
            pays = verify_plan.drafting_pays(c["p_est"], live, buckets, bs, plan.costs)
            c["probe_gap"] = verify_plan.next_probe_gap(draft_now, pays, c["probe_gap"], plan.probe_every)
        vlen = jnp.maximum(lens, 1)  # finished rows verify nothing; their results are discarded
        inputs = fused.head_inputs(drafts, vlen, c["num_out"], seed, max_new_cap + bs) if use_head else None
        scored, ctx, new_cache_ = verify_packed(
            target, jnp.concatenate([c["bonus"][:, None], drafts], axis=1), lens, c["tcache"],
            verify_shapes(b, bs, buckets), k + 1, layer_ids=layer_ids, attn_impl=attn_impl,
            drafter=drafter, ctx=c["ctx"], head_inputs=inputs, **sampling)
        if greedy:
            accepted, nxt = acceptance.greedy_accept_ids(drafts, scored, vlen)
        elif use_head:
            accepted, nxt = fused.accept(scored, drafts, vlen, inputs)
        else:
            accepted, nxt = acceptance.sample_accept(drafts, scored, vlen, accept_keys, q)
        return drafts, accepted, nxt, ctx, new_cache_, lens, draft_now

    def body(c):
        c = dict(c)
        done, num_out = c["done"], c["num_out"]
        step_keys = token_keys(seed_key, rows, num_out)
        draft_keys, accept_keys = jax.vmap(lambda k: jax.random.split(k, 2))(step_keys).swapaxes(0, 1)
        if policy == "fixed":
            drafts, q, _ = draft(c, draft_keys)
            accepted, nxt, ctx, vcache, lens = fixed_verify(c, drafts, q, accept_keys)
            drafted = jnp.bool_(True)
        else:
            drafts, accepted, nxt, ctx, vcache, lens, drafted = adaptive_step(c, draft_keys, accept_keys)
        emitted = emitted_tokens(drafts, accepted, nxt)
        idx = jnp.arange(bs)[None]
        stops = is_stop(emitted, eos_ids) & (idx <= accepted[:, None])
        n_emit = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1, accepted + 1)
        n_emit = jnp.where(done, 0, jnp.minimum(n_emit, max_new - num_out))
        write = jnp.where(idx < n_emit[:, None], num_out[:, None] + idx, max_new_cap + bs)
        start = c["tcache"].lengths
        new_len = start + n_emit
        last = jnp.take_along_axis(emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
        num_out = num_out + n_emit
        c.update(tcache=vcache.with_lengths(new_len),
                 ctx=ctx.with_lengths(new_len),
                 bonus=jnp.where(n_emit > 0, last, c["bonus"]),
                 out=c["out"].at[rows[:, None], write].set(emitted, mode="drop"), num_out=num_out,
                 done=done | jnp.any(stops & (idx < n_emit[:, None]), axis=1) | (num_out >= max_new),
                 commits=c["commits"].at[:, c["step"]].set(n_emit),
                 verified=c["verified"].at[:, c["step"]].set(jnp.where(done, 0, lens)),
                 drafted=c["drafted"].at[c["step"]].set(drafted), step=c["step"] + 1)
        return c

    carry = dict(tcache=tcache, ctx=ctx, bonus=first, out=out, num_out=num_out, done=done,
                 commits=jnp.zeros((b, max_new_cap), jnp.int32),
                 verified=jnp.zeros((b, max_new_cap), jnp.int32),
                 drafted=jnp.zeros((max_new_cap,), bool), step=jnp.int32(0))
    if policy == "auto":
        carry.update(p_est=jnp.full((b,), plan.start.p, jnp.float32), since_draft=plan.start.since_draft,
                     probe_gap=plan.start.gap)
    final = jax.lax.while_loop(cond, body, carry)
    probe = None
    if policy == "auto":
        real = active.astype(jnp.float32)
        probe = verify_plan.ProbeState(jnp.sum(final["p_est"] * real) / jnp.maximum(jnp.sum(real), 1.0),
                                       final["since_draft"], final["probe_gap"])
    return (final["out"], final["num_out"], final["step"], final["commits"], final["verified"],
            final["drafted"], probe)

"""The speculative step of the engine: draft -> verify -> accept -> commit/rollback.

Per slot the engine state (`engine_state.DecodeState`) keeps the target KV
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
altogether (a plain AR step) when drafting does not pay (`verify_plan`), with
the head's acceptance estimate corrected by each slot's realized acceptance.
At T > 0 with argmax drafts every output position has its own key
(`acceptance.match_accept`, the verify head's counters), so verify lengths,
and hence the batch around a request, never change its seeded tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding import acceptance, verify_plan
from adaflash_jax.decoding import verify_head
from adaflash_jax.decoding.engine_state import DecodeState, PolicyState, commit
from adaflash_jax.decoding.packed_verify import verify_packed, verify_shapes
from adaflash_jax.decoding.sampling import checked_log_probs, stream_keys, target_log_probs
from adaflash_jax.models import draft_vocab
from adaflash_jax.models.drafter import append_context, draft_block


def propose(target, drafter, anchors, ctx_cache, *, greedy, temperature, top_p, keys,
            sample_drafts: bool, attn_impl: str, length_head=None):
    """Draft tokens [B, Bs-1], for sampled drafts their distributions q (else None), and
    the length head's scores ŝ [B] (None without a length head). A head with a confidence
    input also gets each draft's probability under the drafter (temperature 1)."""
    block_hidden = draft_block(drafter, target.embed_tokens, anchors, ctx_cache, attn_impl=attn_impl)
    hidden = block_hidden[:, 1:]
    if greedy or not sample_drafts:
        drafts, q = draft_vocab.greedy_tokens(target, drafter, hidden, attn_impl), None
    else:
        logq = draft_vocab.spread_to_target(drafter, target_log_probs(
            draft_vocab.logits(target, drafter, hidden), temperature, top_p), target.cfg.vocab_size)
        drafts = jax.vmap(lambda k, lq: jax.random.categorical(k, lq, axis=-1))(keys, logq).astype(jnp.int32)
        q = jnp.exp(logq)
    if length_head is None:
        return drafts, q, None
    confidence = None
    if length_head.uses_confidence:  # each draft's probability (the argmax's, for greedy drafts)
        logp = jax.nn.log_softmax(draft_vocab.logits(target, drafter, hidden), axis=-1)
        idx = jnp.maximum(draft_vocab.to_draft(drafter, drafts), 0)
        confidence = jnp.exp(jnp.take_along_axis(logp, idx[..., None], axis=-1)[..., 0])
    return drafts, q, length_head(block_hidden, confidence)


def emitted_tokens(drafts, accepted, nxt):
    """[B, Bs]: accepted drafts, then the target's token at index `accepted`."""
    bs = drafts.shape[1] + 1
    idx = jnp.arange(bs)[None]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return jnp.where(idx < accepted[:, None], padded, jnp.where(idx == accepted[:, None], nxt[:, None], 0))


def spec_step(cfg, target, drafter, length_head, state: DecodeState) -> DecodeState:
    """One draft -> plan -> verify -> accept -> commit step for every live slot.

    cfg: an `engine_state.EngineConfig`; length_head: the AdaFlash length head (policies
    "head" / "auto"). With cfg.use_verify_head, sampled verification runs through the fused
    verify head (`decoding.verify_head`).
    """
    bs, layer_ids, p = cfg.block_size, drafter.cfg.target_layer_ids, state.params
    greedy, use_verify_head = cfg.greedy, cfg.use_verify_head
    sampling = dict(greedy=greedy, temperature=p.temperature[:, None, None],
                    top_p=p.top_p[:, None, None])  # per slot, broadcast over [S, Bs, V]
    step_keys = stream_keys(p.seed_key, p.stream, state.num_out)
    # argmax drafts: one key per output position a block index would emit (as AR steps draw)
    position_keys = jax.vmap(lambda i: stream_keys(p.seed_key, p.stream, state.num_out + i),
                             out_axes=1)(jnp.arange(bs, dtype=jnp.int32))
    draft_keys, accept_keys = jax.vmap(lambda k: jax.random.split(k, 2))(step_keys).swapaxes(0, 1)
    seeds = verify_head.verify_head_seed(p.seed_key) if use_verify_head else None

    def draft():
        return propose(target, drafter, state.bonus, state.ctx, keys=draft_keys,
                       sample_drafts=cfg.sample_drafts, attn_impl=cfg.attn_impl, length_head=length_head,
                       **sampling)

    def verify_head_inputs(drafts, lens):
        return verify_head.verify_head_inputs(drafts, lens, state.num_out, p.stream, seeds, p.temperature,
                                              cfg.out_width)

    def accept(drafts, scored, lens, q):
        """greedy: scored holds the argmax ids (-1 where the logits were not finite); T > 0: the
        verify head's outputs or `CheckedLogProbs`, and a row stops at non-finite logits."""
        if greedy:
            return acceptance.greedy_accept_ids(drafts, scored, lens)
        if use_verify_head:
            accepted, nxt = verify_head.verify_head_accept(scored, drafts, lens)
            finite = jnp.isfinite(scored.lse)  # NaN or +inf anywhere makes the lse so
        else:
            if q is None:
                accepted, nxt = acceptance.match_accept(drafts, scored.logp, lens, position_keys)
            else:
                accepted, nxt = acceptance.sample_accept(drafts, scored.logp, lens, accept_keys, q)
            finite = scored.finite
        return acceptance.stop_at_nonfinite(accepted, nxt, finite)

    if cfg.policy == "fixed":
        drafts, q, _ = draft()
        lens = p.verify_len
        verify = target(jnp.concatenate([state.bonus[:, None], drafts], axis=1), cache=state.tcache,
                        feature_layers=layer_ids, attn_impl=cfg.attn_impl)
        if greedy:  # the head scores indices only while some row still accepts
            scored = acceptance.lazy_greedy_ids(lambda h: target.greedy_tokens(h, cfg.attn_impl),
                                                verify.hidden, drafts, lens)
        elif use_verify_head:
            scored = verify_head.run_verify_head(target, verify.hidden, verify_head_inputs(drafts, lens),
                                                 cfg.attn_impl)
        else:
            scored = checked_log_probs(target.logits(verify.hidden), sampling["temperature"],
                                       sampling["top_p"])
        accepted, nxt = accept(drafts, scored, lens, q)
        ctx_pos = state.tcache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        ctx = append_context(drafter, state.ctx, verify.features, ctx_pos)
        emitted = emitted_tokens(drafts, accepted, nxt)
        return commit(state, emitted, accepted, verify.cache, ctx, jnp.where(state.done, 0, lens), True)

    live, plan, policy = ~state.done, state.plan, state.policy
    if cfg.policy == "head":
        draft_now = jnp.bool_(True)
    else:
        pays = verify_plan.drafting_pays(policy.p_est, live, cfg.buckets, bs, plan.costs)
        draft_now = pays | (policy.since_draft >= policy.probe_gap)
    b, vocab = state.num_slots, target.cfg.vocab_size
    skipped = (jnp.zeros((b, bs - 1), jnp.int32),
               None if greedy or not cfg.sample_drafts else jnp.zeros((b, bs - 1, vocab), jnp.float32),
               jnp.zeros((b,), jnp.float32))
    drafts, q, scores = jax.lax.cond(draft_now, draft, lambda: skipped)
    if cfg.policy == "head":
        lens = verify_plan.head_lengths(scores, live, bs, plan.rho, plan.min_len)
        k = verify_plan.bucket_index(jnp.sum(lens), cfg.buckets)
    else:
        head_p = verify_plan.per_token_acceptance(scores, bs)
        est = verify_plan.corrected_acceptance(head_p, policy.hits, policy.trials, policy.predicted,
                                               plan.prior_trials)
        planned, k_planned, _ = verify_plan.best_allocation(est, live, cfg.buckets, bs, plan.costs)
        # a probe verifies at least one draft per live slot: it exists to observe acceptance
        probe_lens = jnp.where(live, jnp.maximum(planned, 2), 0)
        planned, k_planned = jax.tree.map(
            lambda a, b: jnp.where(pays, a, b), (planned, k_planned),
            (probe_lens, verify_plan.bucket_index(jnp.sum(probe_lens), cfg.buckets)))
        lens = jnp.where(draft_now, planned, live.astype(jnp.int32))
        k = jnp.where(draft_now, k_planned, -1)  # -1: the AR-step shape
    vlen = jnp.maximum(lens, 1)  # finished slots verify nothing; their results are discarded
    scored, ctx, vcache = verify_packed(
        target, jnp.concatenate([state.bonus[:, None], drafts], axis=1), lens, state.tcache,
        verify_shapes(b, bs, cfg.buckets), k + 1, layer_ids=layer_ids, attn_impl=cfg.attn_impl,
        drafter=drafter, ctx=state.ctx,
        verify_head_inputs=verify_head_inputs(drafts, vlen) if use_verify_head else None,
        greedy=greedy, temperature=p.temperature, top_p=p.top_p)
    accepted, nxt = accept(drafts, scored, vlen, q)
    emitted = emitted_tokens(drafts, accepted, nxt)
    new = commit(state, emitted, accepted, vcache, ctx, jnp.where(state.done, 0, lens), draft_now)
    if cfg.policy == "auto":
        new = new.replace(policy=auto_policy_update(cfg, plan, policy, live, draft_now, head_p, accepted, lens))
    return new


def auto_policy_update(cfg, plan, policy: PolicyState, live, drafted, head_p, accepted, lens) -> PolicyState:
    """The "auto" state after a step: drafted live slots fold the step's realized acceptance
    into their feedback and re-estimate (the head's estimate of this block, corrected); the
    probe schedule follows whether drafting pays under the new estimates."""
    observed = drafted & live
    hits, trials, predicted = verify_plan.observe_acceptance(
        policy.hits, policy.trials, policy.predicted, head_p, accepted, lens, observed, plan.feedback_decay)
    est = verify_plan.corrected_acceptance(head_p, hits, trials, predicted, plan.prior_trials)
    p_est = jnp.where(observed, est, policy.p_est)
    pays = verify_plan.drafting_pays(p_est, live, cfg.buckets, cfg.block_size, plan.costs)
    return policy.replace(p_est=p_est, since_draft=jnp.where(drafted, 0, policy.since_draft + 1).astype(jnp.int32),
                          probe_gap=verify_plan.next_probe_gap(drafted, pays, policy.probe_gap, plan.probe_every),
                          hits=hits, trials=trials, predicted=predicted)

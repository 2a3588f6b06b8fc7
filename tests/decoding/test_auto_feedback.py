"""The "auto" policy corrects its length head with each slot's realized acceptance.

A length head forced to score every block ~1 claims every draft will be accepted;
without feedback "auto" would verify whole blocks forever. With feedback, a drafter
that rarely matches is verified in ever shorter blocks, and one that never matches
falls back to AR steps plus backed-off probes. Outputs never change: greedy equals
AR, and at T > 0 a seeded request's tokens equal AR's draws with that seed, whatever
the verify lengths, the other prompts of the batch or the policy state left by
earlier calls.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding import engine, verify_plan
from adaflash_jax.decoding.batching import cache_length, pad_batch
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights, SlotParams
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.models.length_head import LengthHead

MAX_NEW, CAP, PROMPT, PROBE_EVERY = 60, 64, 16, 4
BUCKETS = default_buckets(4, H.BLOCK)


def compute_bound(draft=0.05, per_token=0.05):
    """Verify cost grows with the packed tokens: confident rows earn whole blocks, p ~ 0.3 only
    a token or two, and below ~0.2 plain AR steps win."""
    verify = [1.0 + per_token * n for n in BUCKETS]
    return verify_plan.StepCosts(jnp.asarray(verify, jnp.float32), jnp.float32(draft),
                                 jnp.float32(1.0 + per_token * 4))


def optimistic_head() -> LengthHead:
    """A length head whose score is sigmoid(20) ~ 1 for every block."""
    head = LengthHead(H.TINY.hidden_size, 16, rngs=nnx.Rngs(0))
    head.w_out[...] = jnp.zeros_like(head.w_out[...])
    head.b_out[...] = jnp.full_like(head.b_out[...], 20.0)
    return head


@pytest.fixture(scope="module")
def ar(target):
    return af.generate(target, H.TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).token_ids


@pytest.fixture(scope="module")
def rare(target):
    """An untrained drafter: it matches the target rarely."""
    return af.init_drafter(target, num_layers=2, block_size=H.BLOCK, seed=11).with_length_head(optimistic_head())


@pytest.fixture(scope="module")
def never(rare, ar):
    """A drafter whose final norm is zero: every draft is token 0 (logits all 0), which the
    target never emits after these prompts."""
    assert not any(0 in row for row in ar)
    module = rare.module
    module.norm[...] = jnp.zeros_like(module.norm[...])
    return dataclasses.replace(rare, state=nnx.state(module), name="never-matching")


def decode(target, drafter, prompts=H.TEST_PROMPTS, **plan_kw):
    """`generate`'s engine call (greedy, "auto" under compute-bound costs), returning the raw
    per-request-step counts: (tokens, verified [B, cap], drafted steps, steps)."""
    batch = pad_batch(prompts, max_prompt_len=PROMPT, pad_to=PROMPT)
    cfg = EngineConfig(target_def=target.graphdef, cache_len=cache_length(PROMPT, CAP, H.BLOCK),
                       max_new_cap=CAP, greedy=True, drafter_def=drafter.graphdef, block_size=H.BLOCK,
                       length_head_def=drafter.head_graphdef, policy="auto", buckets=BUCKETS)
    plan = verify_plan.PlanParams(jnp.float32(1.3), jnp.int32(1), compute_bound(), jnp.int32(PROBE_EVERY),
                                  verify_plan.ProbeState.fresh(PROBE_EVERY), **plan_kw)
    params = SlotParams.build(np.where(batch.active, MAX_NEW, 0), temperature=1.0, top_p=1.0, seeds=0,
                              streams=np.arange(batch.batch), verify_len=1)
    out = engine.decode_batch(cfg, EngineWeights(target.state, drafter.state, drafter.head_state),
                              jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), params,
                              jnp.zeros((0,), jnp.int32), plan)
    num = np.asarray(out.num_out)
    tokens = [np.asarray(out.tokens)[i, :num[i]].tolist() for i in range(len(prompts))]
    return tokens, np.asarray(out.verified)[:len(prompts)], int(out.drafted_steps), int(out.steps)


def test_rule_calibrates_the_head_to_realized_acceptance():
    head = jnp.asarray([0.999, 0.9, 0.6], jnp.float32)
    zero = jnp.zeros(3, jnp.float32)
    assert np.array_equal(verify_plan.corrected_acceptance(head, zero, zero, zero, 1.0), head)
    hits, trials, predicted = zero, zero, zero
    for _ in range(60):  # every step verifies 4 drafts and accepts 1: realized p = 1/2
        hits, trials, predicted = verify_plan.observe_acceptance(
            hits, trials, predicted, head, jnp.full(3, 1), jnp.full(3, 5), jnp.ones(3, bool), 0.95)
    p = np.asarray(verify_plan.corrected_acceptance(head, hits, trials, predicted, 1.0))
    np.testing.assert_allclose(p, 0.5, atol=0.03)  # every row's head corrected to what it realizes
    # the correction is a log-odds shift: a block the head rates higher stays higher
    other = np.asarray(verify_plan.corrected_acceptance(jnp.full(3, 0.3), hits, trials, predicted, 1.0))
    assert np.all(other < p)
    # rows that did not verify a draft keep their counts
    kept = verify_plan.observe_acceptance(hits, trials, predicted, head, jnp.zeros(3, jnp.int32),
                                          jnp.asarray([5, 1, 5]), jnp.asarray([False, True, True]), 0.95)
    assert float(kept[1][0]) == float(trials[0]) and float(kept[1][1]) == float(trials[1])
    assert float(kept[1][2]) == pytest.approx(0.95 * float(trials[2]) + 1)


def test_over_optimistic_head_learns_shorter_verification(target, rare, ar):
    tokens, verified, _, _ = decode(target, rare)
    assert tokens == ar  # greedy output is the target's
    first, late = verified[:, 0], np.concatenate([row[20:][row[20:] > 0] for row in verified])
    assert np.all(first == H.BLOCK)  # the head alone asks for whole blocks
    assert late.mean() < 4, late.mean()
    # the same run with the feedback outweighed by the head's prior keeps verifying whole blocks
    _, blind, _, _ = decode(target, rare, prior_trials=jnp.float32(1e9))
    blind_late = np.concatenate([row[20:][row[20:] > 0] for row in blind])
    assert blind_late.mean() > 12, blind_late.mean()


def test_never_matching_drafter_falls_back_to_ar(target, never, ar):
    tokens, verified, drafted, steps = decode(target, never)
    assert tokens == ar
    assert steps == MAX_NEW - 1  # nothing is ever accepted: one token per step
    drafted_at = np.flatnonzero(verified[0, :steps] > 1)
    # a few drafted steps while the estimate falls, then probes only, ever rarer
    assert drafted <= 12 and len(drafted_at) <= drafted, (drafted, drafted_at)
    assert np.sum(drafted_at >= steps // 2) <= 2, drafted_at
    assert np.all(verified[:, :steps] >= 1)


def test_new_requests_start_from_the_running_estimate_without_feedback(target, rare):
    cfg = EngineConfig(target_def=target.graphdef, cache_len=cache_length(PROMPT, CAP, H.BLOCK),
                       max_new_cap=CAP, greedy=True, drafter_def=rare.graphdef, block_size=H.BLOCK,
                       length_head_def=rare.head_graphdef, policy="auto", buckets=BUCKETS)
    weights = EngineWeights(target.state, rare.state, rare.head_state)
    start = verify_plan.ProbeState(jnp.float32(0.4), jnp.int32(0), jnp.int32(PROBE_EVERY))
    plan = verify_plan.PlanParams(jnp.float32(1.3), jnp.int32(1), compute_bound(), jnp.int32(PROBE_EVERY), start)
    state = engine.init_state_jit(cfg, weights, 4, jnp.zeros((0,), jnp.int32), plan)
    busy = jnp.asarray([3.0, 5.0, 7.0, 9.0], jnp.float32)
    state = state.replace(policy=state.policy.replace(p_est=busy / 10, hits=busy, trials=busy + 1,
                                                      predicted=busy))
    state = engine.evict_jit(state, jnp.asarray([1], jnp.int32))  # mean of all four: 0.6
    batch = pad_batch([H.TEST_PROMPTS[0]], max_prompt_len=PROMPT, pad_to=PROMPT)
    params = SlotParams.build([8], temperature=1.0, top_p=1.0, seeds=0, streams=0, verify_len=1)
    insert = lambda st, slot: engine.insert_jit(cfg, weights, st, jnp.asarray([slot], jnp.int32),  # noqa: E731
                                                jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), params)
    state = insert(state, 2)  # slots 0, 2, 3 have feedback (2's request is being replaced)
    pol = state.policy
    np.testing.assert_allclose(pol.p_est, [0.3, 0.6, (0.3 + 0.7 + 0.9) / 3, 0.9], rtol=1e-6)
    for counts in (pol.hits, pol.trials - 1, pol.predicted):
        np.testing.assert_allclose(np.asarray(counts)[[0, 3]], [3.0, 9.0])
    assert np.all(np.asarray(pol.trials)[1:3] == 0) and np.all(np.asarray(pol.hits)[1:3] == 0)
    # once every request has left, a new one starts from the last estimate, not the initial 0.4
    state = engine.evict_jit(state, jnp.arange(4, dtype=jnp.int32))
    state = insert(state, 0)
    np.testing.assert_allclose(state.policy.p_est[0], (0.3 + 0.9) / 2, rtol=1e-6)


def sampled(target, drafter, prompts, **kw):
    return af.generate(target, prompts, drafter=drafter, max_new_tokens=MAX_NEW, stop_token_ids=(),
                       temperature=0.3, seed=5, **kw)


@pytest.mark.parametrize("verify_head", [False, True])
def test_seeded_samples_ignore_batch_and_earlier_calls(target, verify_head):
    """Under "auto" the verify lengths depend on the whole batch and on the policy state an
    earlier call left; a seeded request's tokens must not."""
    drafter = H.distilled_drafter().with_length_head(LengthHead(H.TINY.hidden_size, 16, rngs=nnx.Rngs(3)))
    kw = dict(length_policy="auto", step_costs=compute_bound(per_token=0.02), verify_head=verify_head)
    others = H.random_prompts(3, seed=8)
    first = sampled(target, drafter, H.TEST_PROMPTS, **kw)
    crowded = sampled(target, drafter, H.TEST_PROMPTS[:1] + others, **kw)
    again = sampled(target, drafter, H.TEST_PROMPTS, **kw)
    assert crowded.token_ids[0] == first.token_ids[0] and again.token_ids == first.token_ids
    # whole blocks verified every step: other verify lengths, the same tokens
    whole = sampled(target, drafter, H.TEST_PROMPTS, length_policy="fixed", verify_head=verify_head)
    assert whole.token_ids == first.token_ids
    assert whole.stats["mean_verify_len"] > 2 * first.stats["mean_verify_len"]
    if not verify_head:  # argmax drafts + match rule: the very tokens AR draws with this seed
        plain = af.generate(target, H.TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=(),
                            temperature=0.3, seed=5)
        assert first.token_ids == plain.token_ids

"""The adaptive decoder (`decoding.adaptive`), the default of `generate(..., drafter=d)`.

Its output is the target's own: greedy equals greedy AR at batch 4 and 32, and at
T > 0 the tokens are those of AR sampling with the same seed (the coupled tree walk),
so a seeded request never depends on its neighbours. A drafter that always matches
drafts every step without one plain AR run; one that does not stops drafting after a
bounded probe and decodes in the AR program (probed by shadow probes, scored against
the tokens the AR steps commit), whose drafter context is filled in later
from the feature ring exactly as if it had been appended step by step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target, drafter  # noqa: F401 (fixtures)
from adaflash_jax.decoding.adaptive import costs as adaptive_costs, packed_step, programs, realized_gain
from adaflash_jax.decoding.adaptive.packed_step import engine_shapes
from adaflash_jax.decoding.batching import cache_length
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights, SlotParams
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState, StepCosts
from adaflash_jax.errors import InputError
from adaflash_jax.models.drafter import append_context, new_context_cache

NEW = 40
BUDGETS = (1, 2, 4, 8, 16, 32)


def costs(per_node: float, batch: int = 4) -> StepCosts:
    """Step seconds: an AR step costs 1, a drafted step 1 + per_node · (nodes per slot)."""
    verify = [1.0 + per_node * tokens / batch for tokens, _ in engine_shapes(batch, BUDGETS)]
    return StepCosts(jnp.asarray(verify, jnp.float32), jnp.float32(0.0), jnp.float32(1.0))


CHEAP, COSTLY = costs(0.01), costs(0.5)
FAR_FROM_PAYING = costs(2.0)  # a drafted step costs 3 AR steps: probes wait out the doubling gap


@pytest.fixture(scope="module")
def untrained(target):
    return af.init_drafter(target, num_layers=2, block_size=H.BLOCK, seed=11)


def ar_ids(target, prompts, new=NEW, **kw):
    return af.generate(target, prompts, max_new_tokens=new, stop_token_ids=(), **kw).token_ids


def adaptive(target, drafter, prompts, step_costs, new=NEW, **kw):
    return af.generate(target, prompts, drafter=drafter, max_new_tokens=new, stop_token_ids=(),
                       step_costs=step_costs, **kw)


def test_default_with_a_matching_drafter_drafts_every_step(target, drafter):
    res = adaptive(target, drafter, H.TEST_PROMPTS, CHEAP)
    assert res.token_ids == ar_ids(target, H.TEST_PROMPTS)
    st = res.stats
    assert st["verify"] == "adaptive" and st["tree_budget"] == "auto" and st["tree_budgets"] == list(BUDGETS)
    assert st["drafted_step_fraction"] == 1.0 and st["program_runs"]["ar"] == 0 and st["ar_steps"] == 0
    assert st["mean_tau"] > 3
    assert st["realized_gain"] > 1.0  # it accepted more drafts than its probabilities expected


def test_spec_runs_hand_back_to_the_host_for_re_pricing(target, drafter):
    """Even while drafting always pays, a spec run returns every SPEC_RUN_STEPS steps, so the
    host corrects the costs it plans with by what the run took (`online_costs`)."""
    res = adaptive(target, drafter, H.TEST_PROMPTS, CHEAP, new=96)
    assert res.token_ids == ar_ids(target, H.TEST_PROMPTS, new=96)
    st = res.stats
    assert st["ar_steps"] == 0 and st["steps"] > programs.SPEC_RUN_STEPS
    assert st["program_runs"]["spec"] == -(-st["steps"] // programs.SPEC_RUN_STEPS), st


def test_drafting_to_the_last_slot_of_a_cache_without_headroom(target, drafter):
    """The adaptive decoder's cache is AR's (prompt bucket + new tokens, no tree headroom): 16-token
    prompts and 48 new tokens fill its 64 slots exactly, and the deep trees of the last steps
    (their nodes past the end, their writes there dropped) still give AR's tokens."""
    # the target's own greedy trajectories, cut at 16 tokens: text the drafter was distilled on
    prompts = [row[:16] for row in H.greedy_rows(target, H.TEST_PROMPTS, 16)]
    assert {len(p) for p in prompts} == {16} and cache_length(16, 48) == 64
    res = adaptive(target, drafter, prompts, CHEAP, new=48)
    assert res.token_ids == ar_ids(target, prompts, new=48)
    # drafting goes on to the cache's last slot: all or all but one of its 32-33 steps draft
    assert res.stats["drafted_step_fraction"] > 0.9 and res.stats["mean_tau"] > 1.2


def test_a_drafter_that_does_not_pay_runs_ar_steps_after_a_bounded_probe(target, untrained):
    prompts = H.TEST_PROMPTS
    res = adaptive(target, untrained, prompts, FAR_FROM_PAYING, new=96)
    assert res.token_ids == ar_ids(target, prompts, new=96)
    st = res.stats
    # the first probe of a decoder that knows nothing verifies its drafts; the later ones, at
    # gaps 8, 16, 32, 64, are shadow probes, scored by the tokens the AR steps commit
    assert st["steps"] - st["ar_steps"] == 1 and st["program_runs"]["probe"] >= 2, st
    assert st["realized_gain"] == 1.0  # its drafted step gave each row its root alone: nothing promised
    # runs of plain AR steps longer than the ring hand their features over without drafting
    assert st["program_runs"]["ar"] >= 2 and st["program_runs"]["catch_up"] >= 1, st


def test_greedy_equals_ar_at_batch_32(target, drafter):
    prompts = H.TEST_PROMPTS + H.random_prompts(28, seed=5)
    res = adaptive(target, drafter, prompts, costs(0.05, batch=32))
    assert res.stats["padded_batch"] == 32
    assert res.token_ids == ar_ids(target, prompts)


def test_sampled_tokens_are_ar_samples_of_the_same_seed(target, drafter, untrained):
    kw = dict(temperature=0.8, seed=7)
    want = ar_ids(target, H.TEST_PROMPTS, **kw)
    for d, c in ((drafter, CHEAP), (untrained, COSTLY)):
        assert adaptive(target, d, H.TEST_PROMPTS, c, **kw).token_ids == want


def test_a_seeded_request_does_not_depend_on_its_neighbours(target, drafter):
    kw = dict(temperature=1.0, top_p=0.9, seed=3)
    alone = adaptive(target, drafter, H.TEST_PROMPTS[:1], costs(0.01, batch=1), **kw).token_ids[0]
    others = [H.TEST_PROMPTS[0]] + H.random_prompts(3, seed=9)
    assert adaptive(target, drafter, others, CHEAP, **kw).token_ids[0] == alone


def test_catch_up_fills_the_context_as_step_by_step_appends_would(target, drafter):
    """AR steps keep features in the ring; one catch-up then gives the drafter the context
    K/V that projecting the whole committed sequence gives."""
    prompt = np.asarray([H.TEST_PROMPTS[1] + [0] * 10], np.int32)
    cfg = EngineConfig(target_def=target.graphdef, cache_len=128, max_new_cap=32, greedy=True,
                       drafter_def=drafter.graphdef, block_size=H.BLOCK, verify="tree", tree_budget=32,
                       policy="auto", buckets=BUDGETS)
    weights = EngineWeights(target.state, drafter.state)
    plan = PlanParams(jnp.float32(1.3), jnp.int32(1), COSTLY, jnp.int32(1000), ProbeState.fresh(1000))
    params = SlotParams.build(np.asarray([32]), temperature=1e-6, top_p=1.0, seeds=0, streams=np.arange(1),
                              verify_len=np.ones((1,), np.int32))
    state, _ = programs.start_jit(cfg, weights, jnp.asarray(prompt), jnp.asarray([6]), params,
                                  jnp.zeros((0,), jnp.int32), plan, jnp.int32(32))
    t, d = nnx.merge(target.graphdef, target.state), nnx.merge(drafter.graphdef, drafter.state)
    steps = 20
    for _ in range(steps):
        state = programs.ar_feature_step(cfg, t, d, state)
    assert int(state.ctx.lengths[0]) == 6 and int(state.tcache.lengths[0]) == 6 + steps
    state = programs.catch_up(cfg, d, state)
    n = 6 + steps
    seq = jnp.concatenate([jnp.asarray(prompt[:, :6]), state.out[:, :steps]], axis=1)
    feats = t(seq, feature_layers=d.cfg.target_layer_ids).features
    ref = append_context(d, new_context_cache(d, 1, 128), feats, jnp.arange(n)[None])
    assert int(state.ctx.lengths[0]) == n
    np.testing.assert_allclose(np.asarray(state.ctx.k[:, :, :, :n]), np.asarray(ref.k[:, :, :, :n]),
                               atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(state.ctx.v[:, :, :, :n]), np.asarray(ref.v[:, :, :, :n]),
                               atol=2e-5, rtol=1e-4)


def test_mode_arguments(target, drafter):
    p = H.TEST_PROMPTS[:1]
    with pytest.raises(InputError, match="verify must be one of"):
        af.generate(target, p, drafter=drafter, verify="fast")
    with pytest.raises(InputError, match="chooses its own budgets"):
        af.generate(target, p, drafter=drafter, verify="adaptive", tree_budget=8)
    with pytest.raises(InputError, match="need a drafter"):
        af.generate(target, p, verify="adaptive")
    # a chain setting alone picks chain verification, a tree budget alone a tree
    assert af.generate(target, p, drafter=drafter, max_new_tokens=8, verify_len=4).stats["verify"] == "chain"
    assert af.generate(target, p, drafter=drafter, max_new_tokens=8, tree_budget=4).stats["verify"] == "tree"


def _flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    return float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])


def test_calibration_times_programs_that_run_the_model(target, drafter):
    """The timed steps output the whole state: an output of a few counters would let XLA drop
    the model, and a 0.1 ms "AR step" would make drafting look never worth it. Both timed
    programs cost at least one of the target's MLP matmuls per layer for every slot."""
    batch = 4
    cfg = EngineConfig(target_def=target.graphdef, cache_len=128, max_new_cap=32, greedy=True,
                       drafter_def=drafter.graphdef, block_size=H.BLOCK, verify="tree", tree_budget=32,
                       policy="auto", buckets=BUDGETS)
    weights = EngineWeights(target.state, drafter.state)
    state = adaptive_costs.timing_state(cfg, weights, batch)
    tcfg = target.model.cfg
    mlp = 2 * tcfg.hidden_size * tcfg.intermediate_size * tcfg.num_layers * batch
    assert _flops(adaptive_costs._ar_step.lower(cfg, weights, state).compile()) >= mlp
    counts = adaptive_costs.fill_counts(batch, *engine_shapes(batch, BUDGETS)[-1])
    drafted = adaptive_costs._drafted_step.lower(cfg, weights, state, counts, len(engine_shapes(batch, BUDGETS)) - 1)
    assert _flops(drafted.compile()) >= mlp * 2


def test_budgets_follow_the_realized_gain_factor(target, drafter):
    """The allocation plans with the tree's expectations times the realized-gain factor: the
    same step verifies fewer nodes when drafting has been delivering a quarter of what it
    promised, and the step adds its accepted and expected drafts to the sums."""
    cfg = EngineConfig(target_def=target.graphdef, cache_len=128, max_new_cap=32, greedy=True,
                       drafter_def=drafter.graphdef, block_size=H.BLOCK, verify="tree", tree_budget=32,
                       policy="auto", buckets=BUDGETS)
    weights = EngineWeights(target.state, drafter.state)
    plan_costs = costs(0.05)

    @jax.jit
    def step(weights, state):
        return packed_step.adaptive_step(cfg, *programs.models(cfg, weights), state)[0]

    def verified(gain):
        state = adaptive_costs.timing_state(cfg, weights, 4)
        new = step(weights, state.replace(plan=state.plan._replace(costs=plan_costs),
                                          policy=state.policy.replace(gain=gain)))
        return int(np.asarray(new.verified).sum()), new.policy.gain

    full, learned = verified(realized_gain.RealizedGain.fresh())
    low, _ = verified(realized_gain.RealizedGain(jnp.float32(0.0), jnp.float32(1e6)))
    assert low < full
    assert float(learned.promised) > 0.0  # the step held its outcome against what it expected

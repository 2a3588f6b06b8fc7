"""The "auto" tree budget: expected acceptance from the tree, the budget choice, and generate.

The expected accepted length of a prefix of a best-first tree is checked against a
direct sum of path probabilities; a drafter whose marginals carry the target's chain
with certainty picks budgets of at least the block size; a slot whose realized
acceptance is zero stops drafting. Through `generate` (fixed step costs, so runs are
deterministic): greedy output equals AR, an untrained drafter under costly
verification falls back to AR steps, a distilled drafter with cheap verification
verifies large trees.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding import tree_policy as tp
from adaflash_jax.decoding.tree_build import ancestor_mask, build_tree
from adaflash_jax.decoding.verify_plan import StepCosts, feedback_shift
from adaflash_jax.errors import InputError

BUDGETS = tp.auto_budgets(H.BLOCK)
NEW = 40


def costs(per_node: float, ar: float = 1.0) -> StepCosts:
    return StepCosts(jnp.asarray([1.0 + per_node * n for n in BUDGETS], jnp.float32), jnp.float32(0.0),
                     jnp.float32(ar))


def test_auto_budgets_go_from_ar_to_twice_the_block():
    assert tp.auto_budgets(16) == (1, 2, 4, 8, 16, 32) and tp.auto_budgets(4) == (1, 2, 4, 8)


def test_expected_accepted_sums_path_probabilities():
    rng = np.random.default_rng(0)
    lp = jax.nn.log_softmax(jnp.asarray(2 * rng.standard_normal((3, 4, 6)), jnp.float32), axis=-1)
    tree = build_tree(lp, jnp.zeros((3,), jnp.int32), 12)
    cum = np.asarray(tp.expected_accepted(tree, ancestor_mask(tree, 4), jnp.zeros((3,))))
    scores, valid = np.asarray(tree.scores), np.asarray(tree.valid)
    for n in range(1, 13):
        direct = np.sum(np.where(valid[:, 1:n], np.exp(scores[:, 1:n]), 0.0), axis=1)
        np.testing.assert_allclose(cum[:, n - 1], direct, rtol=1e-5, atol=1e-6)
    # a positive shift raises every expectation, a negative one lowers it
    up = np.asarray(tp.expected_accepted(tree, ancestor_mask(tree, 4), jnp.full((3,), 2.0)))
    down = np.asarray(tp.expected_accepted(tree, ancestor_mask(tree, 4), jnp.full((3,), -2.0)))
    assert np.all(up[:, -1] > cum[:, -1]) and np.all(down[:, -1] < cum[:, -1])


def test_a_certain_drafter_picks_a_budget_of_at_least_the_block():
    bs, v = H.BLOCK, 10
    chain = np.arange(1, bs) % v
    lp = np.full((2, bs - 1, v), -30.0, np.float32)
    lp[:, np.arange(bs - 1), chain] = 0.0
    lp = jax.nn.log_softmax(jnp.asarray(lp), axis=-1)
    roots = jnp.zeros((2,), jnp.int32)
    tree = build_tree(lp, roots, 32)
    expected = tp.budget_expectations(tp.expected_accepted(tree, ancestor_mask(tree, bs - 1), jnp.zeros((2,))),
                                      BUDGETS)
    np.testing.assert_allclose(np.asarray(expected[0]), [0, 1, 3, 7, 15, 15], atol=1e-3)
    k, _ = tp.drafted_choice(expected, jnp.ones((2,), bool), BUDGETS, costs(0.05))
    assert BUDGETS[int(k)] == 16
    assert bool(tp.drafting_pays(jnp.ones((2,)), jnp.ones((2,), bool), BUDGETS, bs, costs(0.05)))


def test_feedback_of_a_missing_drafter_stops_drafting():
    hits, trials, predicted = jnp.zeros((2,)), jnp.full((2,), 20.0), jnp.full((2,), 12.0)
    r = tp.realized_acceptance(hits, trials, predicted, 1.0)
    assert np.all(np.asarray(r) < 0.05)
    assert np.all(np.asarray(feedback_shift(hits, trials, predicted, 1.0)) < -2)
    assert not bool(tp.drafting_pays(r, jnp.ones((2,), bool), BUDGETS, H.BLOCK, costs(0.05)))


def test_level_feedback_counts_the_levels_the_walk_saw():
    lp = jax.nn.log_softmax(jnp.asarray([[[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]]), axis=-1)
    tree = build_tree(lp, jnp.zeros((1,), jnp.int32), 4)  # root -> {0, 1}, 0 -> {best of offset 2}
    q0 = np.exp(np.asarray(lp[0, 0]))
    path = jnp.asarray([[0, 0, 0]])
    examined, predicted = tp.level_feedback(tree, path, jnp.asarray([0]))  # rejected at the root
    assert int(examined[0]) == 1
    np.testing.assert_allclose(float(predicted[0]), q0[0] + q0[1], rtol=1e-5)


@pytest.fixture(scope="module")
def ar(target):
    return af.generate(target, H.TEST_PROMPTS, max_new_tokens=NEW, stop_token_ids=()).token_ids


def auto(target, drafter, step_costs):
    return af.generate(target, H.TEST_PROMPTS, drafter=drafter, max_new_tokens=NEW, stop_token_ids=(),
                       verify="tree", tree_budget="auto", step_costs=step_costs)


def test_distilled_drafter_with_cheap_verification_verifies_large_trees(target, ar):
    res = auto(target, H.distilled_drafter(), costs(0.01, ar=1.01))
    assert res.token_ids == ar
    st = res.stats
    assert st["tree_budget"] == "auto" and st["tree_budgets"] == list(BUDGETS) and st["length_policy"] == "auto"
    assert st["drafted_step_fraction"] == 1.0 and st["mean_verify_len"] > 8 and st["mean_tau"] > 3


def test_untrained_drafter_under_costly_verification_falls_back_to_ar(target, ar):
    untrained = af.init_drafter(target, num_layers=2, block_size=H.BLOCK, seed=11)
    res = auto(target, untrained, StepCosts(jnp.asarray([1.0, 1.5, 2, 2.5, 3, 4], jnp.float32),
                                            jnp.float32(0.0), jnp.float32(1.0)))
    assert res.token_ids == ar
    assert res.stats["drafted_step_fraction"] < 0.15 and res.stats["mean_verify_len"] < 1.2


def test_auto_budget_arguments(target):
    d = H.distilled_drafter()
    with pytest.raises(InputError, match="tree_budget must be a number"):
        af.generate(target, H.TEST_PROMPTS[:1], drafter=d, verify="tree", tree_budget="big")
    with pytest.raises(InputError, match="one verify_s per budget"):
        af.generate(target, H.TEST_PROMPTS[:1], drafter=d, max_new_tokens=4, verify="tree", tree_budget="auto",
                    step_costs=StepCosts(jnp.ones((2,)), jnp.float32(0), jnp.float32(1)))


def test_calibrated_costs_are_measured_once_and_keep_output(target, ar, tmp_path, monkeypatch):
    from adaflash_jax.decoding import calibration
    from adaflash_jax.decoding.tree_costs import calibrate_tree

    monkeypatch.setenv("ADAFLASH_COST_CACHE", str(tmp_path / "costs.json"))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    d = H.distilled_drafter()
    res = af.generate(target, H.TEST_PROMPTS, drafter=d, max_new_tokens=NEW, stop_token_ids=(), verify="tree",
                      tree_budget="auto")
    assert res.token_ids == ar
    costs = calibrate_tree(target, d, batch=len(H.TEST_PROMPTS), cache_len=64, budgets=(1, 2), repeats=1)
    assert costs.verify_s.shape == (2,) and float(costs.ar_s) == float(costs.verify_s[0]) > 0
    assert (tmp_path / "costs.json").exists()

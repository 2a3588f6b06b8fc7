"""Tree verification through the host scheduler: a fixed node budget and the "auto" budget
in `LocalEngine`. The output stays the target's own (greedy: AR tokens; seeded sampling:
the same tokens whatever shares the slots)."""

import jax.numpy as jnp
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding.tree_policy import auto_budgets
from adaflash_jax.decoding.verify_plan import StepCosts
from adaflash_jax.serving.scheduler import Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine

SLOTS, PROMPT, CAP = 4, 16, 40
BUDGETS = auto_budgets(H.BLOCK)


def flat_costs(k):
    """Every budget costs one AR step (no calibration): the policy drafts whenever a tree pays."""
    return StepCosts(jnp.ones((len(BUDGETS),), jnp.float32), jnp.float32(0.0), jnp.float32(1.0))


def engine(target, budget, *, greedy=True, **kw):
    return LocalEngine(target, H.distilled_drafter(), num_slots=SLOTS, max_prompt_len=PROMPT, max_new_tokens=CAP,
                       greedy=greedy, tree_budget=budget, step_costs=flat_costs, **kw)


def ar(target, prompt, max_new):
    return af.generate(target, [prompt], max_new_tokens=max_new).token_ids[0]


@pytest.mark.parametrize("budget", [6, "auto"])
def test_greedy_staggered_arrivals_match_ar(target, budget):
    prompts = H.TEST_PROMPTS + H.random_prompts(4, seed=13)
    max_new = [CAP, 1, 9, 30, 17, 3, 25, 12]
    eng = engine(target, budget)
    assert eng.cfg.verify == "tree" and eng.cfg.tree_budget == (6 if budget == 6 else max(BUDGETS))
    assert eng.cfg.cache_len >= PROMPT + CAP + eng.cfg.tree_budget
    assert eng.length_policy == ("fixed" if budget == 6 else "auto")
    got = Scheduler({"greedy": eng}).run([Request(p, m) for p, m in zip(prompts, max_new)],
                                         arrivals=[0, 0, 0, 1, 2, 4, 7, 7])
    assert got == [ar(target, p, m) for p, m in zip(prompts, max_new)]
    assert int(eng.state.drafted_steps) > 0  # tree steps ran, not only AR ones


def test_seeded_sample_under_auto_tree_ignores_co_scheduled_traffic(target):
    prompts = H.TEST_PROMPTS
    probe = Request(prompts[1], 24, temperature=0.9, top_p=0.95, seed=7)
    alone = Scheduler({"sample": engine(target, "auto", greedy=False)}).run([probe])[0]
    others = [Request(p, 10 + 5 * i, temperature=0.5 + 0.2 * i, seed=i) for i, p in enumerate(prompts)]
    crowded = Scheduler({"sample": engine(target, "auto", greedy=False)}).run(
        others + [probe], arrivals=[0, 0, 0, 1, 3])[-1]
    assert len(alone) == 24 and crowded == alone


def test_tree_settings_refused_by_name(target):
    make = dict(num_slots=2, max_prompt_len=PROMPT, max_new_tokens=16)
    with pytest.raises(ValueError, match="needs a drafter"):
        LocalEngine(target, None, tree_budget=4, **make)
    with pytest.raises(ValueError, match="sized by tree_budget"):
        LocalEngine(target, H.distilled_drafter(), tree_budget=4, verify_len=4, **make)
    with pytest.raises(ValueError, match="sized by tree_budget"):
        LocalEngine(target, H.distilled_drafter(), tree_budget="auto", length_policy="head", **make)
    for bad_budget in (0, 129, 8.0):
        with pytest.raises(ValueError, match=r"an int in \[1, 128\]"):
            LocalEngine(target, H.distilled_drafter(), tree_budget=bad_budget, **make)
    bad = LocalEngine(target, H.distilled_drafter(), tree_budget="auto",
                      step_costs=lambda k: StepCosts(jnp.ones((2,)), jnp.float32(0), jnp.float32(1)), **make)
    with pytest.raises(ValueError, match="one verify_s per size"):
        bad.step(1)

"""The adaptive decoder through the host scheduler: the default of `LocalEngine` with a drafter.

Each step the host reads the live prefix's flags and runs an AR step or a drafted step
with per-row budgets; requests arrive and leave between steps, so a slot's feature ring
and drafter context must survive inserts, evictions and prefix sizes that change. The
output stays the target's own: greedy equals AR, and a seeded sample is the AR sample of
that seed (the coupled tree walk), whatever shares the slots.
"""

import jax.numpy as jnp
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding.adaptive.packed_step import engine_shapes
from adaflash_jax.decoding.tree_policy import auto_budgets
from adaflash_jax.decoding.verify_plan import StepCosts
from adaflash_jax.serving.scheduler import Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine

SLOTS, PROMPT, CAP = 4, 16, 40
BUDGETS = auto_budgets(H.BLOCK)


def costs(ar_s: float):
    """k -> StepCosts of a k-row step: every drafted shape costs 1 s, an AR step ar_s."""
    def of_rows(k):
        shapes = engine_shapes(k, BUDGETS)
        return StepCosts(jnp.ones((len(shapes),), jnp.float32), jnp.float32(0.0), jnp.float32(ar_s))
    return of_rows


DRAFT_PAYS, NEVER_PAYS = costs(1.0), costs(1e-3)


@pytest.fixture(scope="module")
def drafter():
    return H.distilled_drafter()


def engine(target, drafter, step_costs=DRAFT_PAYS, *, greedy=True, **kw):
    return LocalEngine(target, drafter, num_slots=SLOTS, max_prompt_len=PROMPT, max_new_tokens=CAP,
                       greedy=greedy, step_costs=step_costs, **kw)


def ar(target, prompt, max_new, **kw):
    return af.generate(target, [prompt], max_new_tokens=max_new, **kw).token_ids[0]


@pytest.mark.parametrize("step_costs", [DRAFT_PAYS, NEVER_PAYS], ids=["drafts", "ar-steps"])
def test_greedy_staggered_arrivals_match_ar(target, drafter, step_costs):
    prompts = H.TEST_PROMPTS + H.random_prompts(4, seed=13)
    max_new = [CAP, 1, 9, 30, 17, 3, 25, 12]
    eng = engine(target, drafter, step_costs)
    assert eng.verify == "adaptive" and eng.cfg.buckets == BUDGETS and eng.state.pending is not None
    got = Scheduler({"greedy": eng}).run([Request(p, m) for p, m in zip(prompts, max_new)],
                                         arrivals=[0, 0, 0, 1, 2, 4, 7, 7])
    assert got == [ar(target, p, m) for p, m in zip(prompts, max_new)]
    drafted, steps = int(eng.state.drafted_steps), int(eng.state.steps)
    if step_costs is DRAFT_PAYS:
        assert drafted > steps // 2  # a distilled drafter pays at these costs
    else:
        assert 0 < drafted < steps // 3  # probes only: the rest are AR steps


def test_seeded_sample_is_the_ar_sample_whatever_shares_the_slots(target, drafter):
    probe = Request(H.TEST_PROMPTS[1], 24, temperature=0.9, top_p=0.95, seed=7)
    ar_engine = LocalEngine(target, None, num_slots=SLOTS, max_prompt_len=PROMPT, max_new_tokens=CAP,
                            greedy=False)
    reference = Scheduler({"sample": ar_engine}).run([probe])[0]
    others = [Request(p, 10 + 5 * i, temperature=0.5 + 0.2 * i, seed=i) for i, p in enumerate(H.TEST_PROMPTS)]
    eng = engine(target, drafter, greedy=False)
    assert eng.cfg.coupled_sampling
    crowded = Scheduler({"sample": eng}).run(others + [probe], arrivals=[0, 0, 0, 1, 3])[-1]
    assert len(reference) == 24 and crowded == reference
    assert int(eng.state.drafted_steps) > 0


def test_mode_settings_refused_by_name(target, drafter):
    make = dict(num_slots=2, max_prompt_len=PROMPT, max_new_tokens=16)
    with pytest.raises(ValueError, match="needs a drafter"):
        LocalEngine(target, None, verify="adaptive", **make)
    with pytest.raises(ValueError, match="verify must be one of"):
        LocalEngine(target, drafter, verify="beam", **make)
    with pytest.raises(ValueError, match="chooses its own budgets"):
        LocalEngine(target, drafter, verify="adaptive", verify_len=4, **make)
    with pytest.raises(ValueError, match="tree_budget applies to verify='tree'"):
        LocalEngine(target, drafter, verify="chain", tree_budget=4, **make)
    assert LocalEngine(target, drafter, verify="tree", **make).cfg.tree_budget == H.BLOCK
    assert LocalEngine(target, drafter, length_policy="fixed", **make).verify == "chain"
    bad = LocalEngine(target, drafter, step_costs=lambda k: StepCosts(jnp.ones((2,)), jnp.float32(0),
                                                                       jnp.float32(1)), **make)
    with pytest.raises(ValueError, match="one verify_s per size"):
        bad.step(1)


def test_on_a_data_mesh_the_tokens_are_one_devices(target, drafter):
    """Slots split over data=2 (8 forced host devices, conftest): each prefix step reads
    its flags across both shards and rounds up to 2 rows; the tokens are AR's."""
    from adaflash_jax.parallel.mesh import make_mesh

    sharded = engine(target, drafter, mesh=make_mesh(data=2, tensor=4))
    assert sharded.step_rows(1) == 2
    prompts = H.TEST_PROMPTS + H.random_prompts(2, seed=5)
    max_new = [CAP, 6, 17, 30, 9]
    got = Scheduler({"greedy": sharded}).run([Request(p, m) for p, m in zip(prompts, max_new)],
                                             arrivals=[0, 1, 1, 3, 6])
    assert got == [ar(target, p, m) for p, m in zip(prompts, max_new)]
    assert int(sharded.state.drafted_steps) > 0
    assert not sharded.state.pending.sharding.is_fully_replicated  # the ring splits with its slots


def test_calibrated_costs_are_corrected_by_the_steps_timings_given_ones_are_not(target, drafter, monkeypatch,
                                                                               tmp_path):
    from adaflash_jax.decoding.adaptive import online_costs

    monkeypatch.setenv("ADAFLASH_COST_CACHE", str(tmp_path / "costs.json"))
    monkeypatch.setattr(online_costs, "_BY_SETTING", {})
    requests = [Request(p, 12) for p in H.TEST_PROMPTS]
    calibrated = engine(target, drafter, step_costs=None)
    got = Scheduler({"greedy": calibrated}).run(requests)
    assert got == [ar(target, r.prompt, 12) for r in requests]
    learned = list(online_costs._BY_SETTING.values())  # one per prefix size stepped
    # the steps' timings (past each program's first, compiling call) moved the scales off 1
    assert learned and any(s.scales() != (1.0, 1.0) for s in learned)
    monkeypatch.setattr(online_costs, "_BY_SETTING", {})
    Scheduler({"greedy": engine(target, drafter)}).run(requests)  # step costs given
    assert online_costs._BY_SETTING == {}

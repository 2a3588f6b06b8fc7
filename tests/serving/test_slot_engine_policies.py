"""AdaFlash through the host scheduler: the "head" and "auto" length policies in `LocalEngine`.

A k-slot live-prefix step runs with the packed buckets and step costs of k rows; the
output stays the target's own (greedy: AR tokens; seeded sampling: the same tokens
whatever shares the slots)."""

import jax
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding.length_policy import unit_costs
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.models.length_head import LengthHead
from adaflash_jax.serving.scheduler import Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine

SLOTS, PROMPT, CAP = 4, 16, 48


@pytest.fixture(scope="module")
def drafter():
    return H.distilled_drafter().with_length_head(LengthHead(H.TINY.hidden_size, 16, rngs=nnx.Rngs(3)))


@pytest.fixture(scope="module")
def prompts():
    return H.TEST_PROMPTS + H.random_prompts(5, seed=11)


def unit(k):
    """Unit step costs of a k-row step (no calibration: fast, and the same on every machine)."""
    return unit_costs(default_buckets(k, H.BLOCK))


def engine(target, drafter, policy, *, greedy=True, slots=SLOTS, **kw):
    return LocalEngine(target, drafter, num_slots=slots, max_prompt_len=PROMPT, max_new_tokens=CAP,
                       greedy=greedy, length_policy=policy, step_costs=unit, **kw)


def ar(target, prompt, max_new, **kw):
    return af.generate(target, [prompt], max_new_tokens=max_new, **kw).token_ids[0]


@pytest.mark.parametrize("policy", ["head", "auto"])
def test_greedy_staggered_arrivals_match_ar(target, drafter, prompts, policy):
    max_new = [CAP, 1, 7, 30, CAP, 3, 19, 11, 25]
    arrivals = [0, 0, 0, 1, 2, 2, 5, 9, 9]  # later requests reuse freed slots; prefixes of 1, 2 and 4
    eng = engine(target, drafter, policy, rho=0.8)
    assert eng.length_policy == policy and eng.cfg.buckets == default_buckets(SLOTS, H.BLOCK)
    sched = Scheduler({"greedy": eng})
    got = sched.run([Request(p, m) for p, m in zip(prompts, max_new)], arrivals=arrivals)
    assert got == [ar(target, p, m) for p, m in zip(prompts, max_new)]
    assert int(eng.state.drafted_steps) > 0  # speculative steps ran, not only AR ones
    assert eng.state.plan.costs is None  # the resting plan: each step brings its own costs


def test_seeded_sample_under_auto_ignores_co_scheduled_traffic(target, drafter, prompts):
    probe = Request(prompts[2], 24, temperature=0.9, top_p=0.95, seed=7)
    eng = engine(target, drafter, "auto", greedy=False)
    alone = Scheduler({"sample": eng}).run([probe])[0]
    assert int(eng.state.drafted_steps) > 0
    others = [Request(p, 10 + 5 * i, temperature=0.5 + 0.2 * i, seed=i) for i, p in enumerate(prompts[:5])]
    crowded = Scheduler({"sample": engine(target, drafter, "auto", greedy=False)}).run(
        others + [probe], arrivals=[0, 0, 0, 0, 1, 3])[-1]
    assert len(alone) == 24 and crowded == alone


def test_prefix_step_below_all_slots_under_auto(target, drafter, prompts):
    """One request in an 8-slot engine steps a 1-row prefix with 1-row buckets and costs;
    the free slots and the state's shared plan are left as they were."""
    asked = []

    def costs(k):
        asked.append(k)
        return unit(k)

    eng = LocalEngine(target, drafter, num_slots=8, max_prompt_len=PROMPT, max_new_tokens=CAP,
                      length_policy="auto", step_costs=costs)
    plan = jax.tree.map(np.asarray, eng.state.plan)
    free = jax.tree.map(np.asarray, eng.state.tcache.lengths[1:])
    got = Scheduler({"greedy": eng}).run([Request(prompts[3], 20)])[0]
    assert got == ar(target, prompts[3], 20)
    assert asked == [1]  # calibrated (here: looked up) once, for the only prefix size stepped
    assert jax.tree.all(jax.tree.map(np.array_equal, plan, jax.tree.map(np.asarray, eng.state.plan)))
    np.testing.assert_array_equal(free, eng.state.tcache.lengths[1:])
    assert int(eng.state.policy.probe_gap) >= 1 and eng.state.policy.p_est.shape == (8,)


def test_policy_defaults_and_refusals(target, drafter):
    make = dict(num_slots=2, max_prompt_len=PROMPT, max_new_tokens=16)
    assert LocalEngine(target, drafter, **make).verify == "adaptive"  # the default, with a head or without
    assert LocalEngine(target, H.distilled_drafter(), **make).verify == "adaptive"
    assert LocalEngine(target, drafter, verify="chain", step_costs=unit, **make).length_policy == "auto"
    assert LocalEngine(target, drafter, verify_len=8, **make).length_policy == "fixed"
    assert LocalEngine(target, H.distilled_drafter(), verify="chain", **make).length_policy == "fixed"
    assert LocalEngine(target, None, **make).length_policy is None
    with pytest.raises(ValueError, match="length head"):
        LocalEngine(target, H.distilled_drafter(), length_policy="head", **make)
    with pytest.raises(ValueError, match="needs a drafter"):
        LocalEngine(target, None, length_policy="auto", **make)
    with pytest.raises(ValueError, match="verify_len applies"):
        LocalEngine(target, drafter, length_policy="head", verify_len=4, **make)
    with pytest.raises(ValueError, match="rho"):
        LocalEngine(target, drafter, length_policy="head", rho=0.0, **make)
    bad = LocalEngine(target, drafter, length_policy="auto", step_costs={1: unit_costs((1, 16))}, **make)
    with pytest.raises(ValueError, match="one verify_s per size"):
        bad.step(1)


def test_build_scheduler_threads_the_policy_and_admission(target, drafter, prompts):
    from adaflash_jax.serving.stream_server import build_scheduler

    sched = build_scheduler(target, drafter, slots=SLOTS, max_prompt_len=PROMPT, max_new_tokens=CAP,
                            modes=("greedy",), length_policy="head", rho=0.8, min_len=2, admission="static")
    eng = sched.pools["greedy"].engine
    assert sched.admission == "static" and eng.length_policy == "head"
    assert float(eng.state.plan.rho) == pytest.approx(0.8) and int(eng.state.plan.min_len) == 2
    requests = [Request(p, m) for p, m in zip(prompts[:5], [20, 5, 9, 12, 7])]
    assert sched.run(requests) == [ar(target, r.prompt, r.max_new_tokens) for r in requests]


def test_auto_on_a_data_mesh_matches_one_device(target, drafter, prompts):
    """Slots split over data=2 (8 forced host devices, conftest): prefix steps round up to
    2 rows, whose buckets and costs are those of 2 rows; the tokens are one device's."""
    from adaflash_jax.parallel.mesh import make_mesh

    mesh = make_mesh(data=2, tensor=4)
    sharded = engine(target, drafter, "auto", mesh=mesh)
    assert sharded.step_rows(1) == 2
    requests = [Request(p, m) for p, m in zip(prompts[:5], [CAP, 6, 17, 30, 9])]
    arrivals = [0, 1, 1, 3, 6]
    got = Scheduler({"greedy": sharded}).run(requests, arrivals=arrivals)
    assert got == [ar(target, r.prompt, r.max_new_tokens) for r in requests]
    policy = sharded.state.policy  # per-slot rows split over data, the probe counters shared
    assert not policy.p_est.sharding.is_fully_replicated and policy.probe_gap.sharding.is_fully_replicated
    assert sharded.state.plan.rho.sharding.is_fully_replicated

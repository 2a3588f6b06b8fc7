"""Continuous batching through the host scheduler: a request's output never depends on
what else shares the slots, when it arrived, or which slot it landed in."""

import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target, drafter  # noqa: F401 (fixtures)
from adaflash_jax.serving.scheduler import QueueFull, Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine

SLOTS, PROMPT, CAP = 4, 16, 48


@pytest.fixture(scope="module")
def prompts():
    return H.TEST_PROMPTS + H.random_prompts(5, seed=11)


def engine(target, drafter=None, greedy=True, slots=SLOTS, eos_ids=None):
    """An engine of chain verification with a drafter (the adaptive default has tests of its own)."""
    return LocalEngine(target, drafter, num_slots=slots, max_prompt_len=PROMPT, max_new_tokens=CAP,
                       greedy=greedy, eos_ids=eos_ids, verify="chain" if drafter is not None else None)


def reference(target, prompt, max_new, drafter=None, **kw):
    if drafter is not None:  # the engine's chain verification (sampled tokens follow its rule)
        kw.setdefault("verify", "chain")
    return af.generate(target, [prompt], max_new_tokens=max_new, drafter=drafter, **kw).token_ids[0]


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_staggered_arrivals_match_per_prompt_generate(target, drafter, prompts, speculative):
    d = drafter if speculative else None
    # mixed max_new (1 and the cap are the edges), more requests than slots, staggered arrivals:
    # later requests land in slots that earlier ones just freed
    max_new = [CAP, 1, 7, 30, CAP, 3, 19, 11, 25][:len(prompts)]
    arrivals = [0, 0, 0, 1, 2, 2, 5, 9, 9][:len(prompts)]
    requests = [Request(p, m) for p, m in zip(prompts, max_new)]
    sched = Scheduler({"greedy": engine(target, d)})
    got = sched.run(requests, arrivals=arrivals)
    for p, m, out in zip(prompts, max_new, got):
        assert out == reference(target, p, m, d)
    assert sched.idle() and sched.running == 0


def test_greedy_stop_token_inside_a_step(target, drafter, prompts):
    """A stop token in the middle of an accepted block ends the request there, as in generate."""
    free = reference(target, prompts[0], CAP, drafter)
    stop = free[len(free) // 2]
    sched = Scheduler({"greedy": engine(target, drafter, eos_ids=(stop,))})
    got = sched.run([Request(p, CAP) for p in prompts[:6]])
    for p, out in zip(prompts[:6], got):
        assert out == reference(target, p, CAP, drafter, stop_token_ids=[stop])
    assert got[0][-1] == stop


def test_seeded_sampling_ignores_co_scheduled_traffic(target, drafter, prompts):
    """The same (prompt, seed) gives the same tokens alone, in a full batch, in another slot."""
    probe = Request(prompts[2], 24, temperature=0.9, top_p=0.95, seed=7)
    alone = Scheduler({"sample": engine(target, drafter, greedy=False)}).run([probe])[0]
    others = [Request(p, 10 + 5 * i, temperature=0.5 + 0.2 * i, seed=i) for i, p in enumerate(prompts[:5])]
    crowded = Scheduler({"sample": engine(target, drafter, greedy=False)}).run(
        others + [probe], arrivals=[0, 0, 0, 0, 1, 3])[-1]
    assert crowded == alone
    assert alone == reference(target, prompts[2], 24, drafter, temperature=0.9, top_p=0.95, seed=7)


def test_greedy_and_sampled_requests_share_a_scheduler(target, prompts):
    sched = Scheduler({"greedy": engine(target), "sample": engine(target, greedy=False)})
    got = sched.run([Request(prompts[0], 12), Request(prompts[1], 12, temperature=1.0, seed=3)])
    assert got[0] == reference(target, prompts[0], 12)
    assert got[1] == reference(target, prompts[1], 12, temperature=1.0, seed=3)


def test_live_prefix_steps_match_full_steps(target, prompts):
    """One request in an 8-slot engine steps 1 row; its output is unchanged."""
    sched = Scheduler({"greedy": engine(target, slots=8)})
    assert sched.run([Request(prompts[3], 20)])[0] == reference(target, prompts[3], 20)


def test_cancel_frees_the_slot_and_the_queue_is_bounded(target, prompts):
    sched = Scheduler({"greedy": engine(target, slots=2)}, max_queue=2)
    a, b = sched.submit(Request(prompts[0], CAP)), sched.submit(Request(prompts[1], CAP))
    with pytest.raises(QueueFull):
        sched.submit(Request(prompts[2], CAP))
    first = sched.iterate()
    assert {u.ticket for u in first} == {a, b} and sched.running == 2
    sched.cancel(a)
    c = sched.submit(Request(prompts[2], 5))
    updates = []
    while not sched.idle():
        updates += sched.iterate()
    assert any(u.ticket == a and u.cancelled for u in updates)
    tokens = [t for u in updates if u.ticket == c for t in u.new_tokens]
    assert tokens == reference(target, prompts[2], 5)


def test_bad_requests_are_refused_with_a_reason(target):
    sched = Scheduler({"greedy": engine(target)})
    with pytest.raises(ValueError, match="not 'sample'"):
        sched.submit(Request([1, 2], 4, temperature=0.7))
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.submit(Request([1, 2], CAP + 1))
    with pytest.raises(ValueError, match="prompt has 0 tokens"):
        sched.submit(Request([], 4))
    with pytest.raises(ValueError, match="greedy=True"):
        Scheduler({"sample": engine(target)})
    assert np.all([sched.waiting == 0, sched.running == 0])


def test_static_admission_waits_for_the_whole_batch(target, prompts):
    """The static baseline admits a new batch only when every slot is free; outputs are the same."""
    requests = [Request(p, m) for p, m in zip(prompts[:6], [30, 4, 4, 4, 9, 9])]
    sched = Scheduler({"greedy": engine(target)}, admission="static")
    for r in requests:
        sched.submit(r)
    sched.iterate()
    assert sched.running == 4 and sched.waiting == 2
    while sched.running:  # the short requests finish, but their slots stay empty
        assert sched.waiting == 2
        sched.iterate()
    sched.iterate()
    assert sched.waiting == 0 and sched.running == 2
    assert Scheduler({"greedy": engine(target)}, admission="static").run(requests) == [
        reference(target, r.prompt, r.max_new_tokens) for r in requests]

"""The engine's slots are independent: what else is decoding never changes a request's output.

Requests arrive staggered into a few slots (inserted between steps, into slots
that were just freed), with mixed prompt lengths, max_new and a stop token;
greedy outputs must equal per-prompt `generate`, and a seeded sampled request
must produce the same tokens whatever its slot and its neighbours.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target, drafter  # noqa: F401 (fixtures)
from adaflash_jax.decoding import engine
from adaflash_jax.decoding.batching import pad_batch
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights, SlotParams
from adaflash_jax.decoding.length_policy import unit_costs
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.decoding.verify_plan import PlanParams, ProbeState
from adaflash_jax.decoding.batching import cache_length
from adaflash_jax.models.length_head import LengthHead

SLOTS, CAP, PROMPT = 4, 64, 16
CACHE = cache_length(PROMPT, CAP, H.BLOCK)  # what generate uses for these tests' shapes
REF_NEW = 60


@pytest.fixture(scope="module")
def prompts():
    return H.TEST_PROMPTS + H.random_prompts(4, seed=3)


class Driver:
    """A minimal host loop over the engine's jitted insert / step / evict."""

    def __init__(self, target, drafter=None, *, greedy=True, eos=(), policy="fixed", verify_head=False):
        spec = drafter is not None
        plan = None
        kw = {}
        if policy != "fixed":
            buckets = default_buckets(SLOTS, H.BLOCK)
            plan = PlanParams(jnp.float32(0.6), jnp.int32(1), unit_costs(buckets), jnp.int32(4),
                              ProbeState.fresh(4))
            kw = dict(policy=policy, buckets=buckets, length_head_def=drafter.head_graphdef)
        self.cfg = EngineConfig(target_def=target.graphdef, cache_len=CACHE, max_new_cap=CAP, greedy=greedy,
                                drafter_def=drafter.graphdef if spec else None,
                                block_size=H.BLOCK if spec else 0, use_verify_head=verify_head, **kw)
        self.weights = EngineWeights(target.state, drafter.state if spec else None,
                                     drafter.head_state if policy != "fixed" else None)
        self.state = engine.init_state_jit(self.cfg, self.weights, SLOTS, jnp.asarray(eos, jnp.int32), plan)

    def insert(self, slot, prompt, max_new, *, temperature=1.0, seed=0, verify_len=H.BLOCK):
        batch = pad_batch([prompt], max_prompt_len=PROMPT, pad_to=PROMPT)
        params = SlotParams.build([max_new], temperature=temperature, top_p=1.0, seeds=seed, streams=0,
                                  verify_len=verify_len)
        self.state = engine.insert_jit(self.cfg, self.weights, self.state, jnp.asarray([slot], jnp.int32),
                                       jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), params)

    def step(self):
        self.state = engine.step_jit(self.cfg, self.weights, self.state)

    def finished(self, occupied):
        """{slot: tokens} of the occupied slots that are done."""
        done, num, out = (np.asarray(x) for x in (self.state.done, self.state.num_out, self.state.out))
        return {s: out[s, :num[s]].tolist() for s in occupied if done[s]}

    def serve(self, requests, arrivals, evict_every_other=True):
        """requests: list of (prompt, max_new, insert kwargs); request i may start at step
        arrivals[i] or later. Returns every request's tokens."""
        waiting, occupied, results, steps = list(range(len(requests))), {}, {}, 0
        while waiting or occupied:
            for slot in range(SLOTS):  # at most one insert per step: staggered arrivals
                if slot not in occupied.values() and waiting and arrivals[waiting[0]] <= steps:
                    i = waiting.pop(0)
                    prompt, max_new, kw = requests[i]
                    self.insert(slot, prompt, max_new, **kw)
                    occupied[i] = slot
                    break
            for i, slot in list(occupied.items()):
                tokens = self.finished([slot]).get(slot)
                if tokens is not None:
                    results[i] = tokens
                    del occupied[i]
                    if evict_every_other and i % 2:  # the others are overwritten by their next insert
                        self.state = engine.evict_jit(self.state, jnp.asarray([slot], jnp.int32))
            if occupied:
                self.step()
            steps += 1
            assert steps < 500
        return [results[i] for i in range(len(requests))]


def expected(full, max_new, stop=None):
    out = full[:max_new]
    return out[:out.index(stop) + 1] if stop is not None and stop in out else out


@pytest.fixture(scope="module")
def reference(target, drafter, prompts):
    """Per-prompt greedy `generate` (speculative), no stop token."""
    return [af.generate(target, [p], drafter=drafter, max_new_tokens=REF_NEW, stop_token_ids=()).token_ids[0]
            for p in prompts]


def mixed_requests(prompts, reference):
    """Mixed lengths and max_new (1 = done at insert); the stop token first appears mid-output
    of request 2 (and wherever else it occurs)."""
    stop = reference[2][11]
    max_new = [7, REF_NEW, REF_NEW, 1, 33, 18, REF_NEW, 45]
    return [(p, m, {}) for p, m in zip(prompts, max_new)], stop


@pytest.mark.parametrize("kind", ["speculative", "autoregressive"])
def test_greedy_outputs_equal_per_prompt_generate(target, drafter, prompts, reference, kind):
    requests, stop = mixed_requests(prompts, reference)
    driver = Driver(target, drafter if kind == "speculative" else None, eos=(stop,))
    got = driver.serve(requests, arrivals=[0, 0, 3, 3, 5, 9, 9, 20])
    want = [expected(reference[i], m, stop) for i, (_, m, _) in enumerate(requests)]
    assert got == want
    assert any(len(w) < m for w, (_, m, _) in zip(want, requests))  # the stop token cut something
    assert any(len(w) == REF_NEW for w in want)  # and some ran to max_new


def test_stop_token_first_and_max_len_edges(target, drafter, prompts, reference):
    # a request whose very first token is the stop token finishes at insert
    first = reference[1][0]
    driver = Driver(target, drafter, eos=(first,))
    requests = [(prompts[1], REF_NEW, {}), (prompts[0], CAP, {}), (prompts[3], REF_NEW, {})]
    got = driver.serve(requests, arrivals=[0, 0, 1])
    assert got[0] == [first]
    full = af.generate(target, [prompts[0]], drafter=drafter, max_new_tokens=CAP,
                       stop_token_ids=()).token_ids[0]
    assert got[1] == expected(full, CAP, first)
    assert got[2] == expected(reference[3], REF_NEW, first)


def test_head_policy_slots_are_independent(target, prompts, reference):
    head = LengthHead(H.TINY.hidden_size, 16, rngs=nnx.Rngs(3))
    with_head = H.distilled_drafter().with_length_head(head)
    requests, stop = mixed_requests(prompts, reference)
    driver = Driver(target, with_head, eos=(stop,), policy="head")
    got = driver.serve(requests, arrivals=[0, 1, 2, 2, 6, 6, 7, 8])
    assert got == [expected(reference[i], m, stop) for i, (_, m, _) in enumerate(requests)]


@pytest.mark.parametrize("verify_head", [False, True])
def test_seeded_samples_ignore_slot_and_neighbours(target, drafter, prompts, verify_head):
    mine = (prompts[2], 40, {"temperature": 0.8, "seed": 7})
    alone = Driver(target, drafter, greedy=False, verify_head=verify_head).serve([mine], arrivals=[0])[0]
    others = [(prompts[i], m, {"temperature": t, "seed": s})
              for i, m, t, s in ((0, 25, 1.5, 1), (5, 40, 0.3, 2), (6, 9, 1.0, 3), (1, 30, 0.8, 7))]
    crowded = Driver(target, drafter, greedy=False, verify_head=verify_head).serve(
        others[:3] + [mine] + others[3:], arrivals=[0, 0, 0, 4, 6])
    assert crowded[3] == alone  # a different slot (3), inserted mid-run, other traffic around it
    assert crowded[4] != alone  # same seed, another prompt: a different stream of draws
    # generate's prompt 0 is stream 0 of its seed: the same request
    res = af.generate(target, [mine[0]], drafter=drafter, max_new_tokens=40, temperature=0.8, seed=7,
                      stop_token_ids=(), verify_head=verify_head)
    assert res.token_ids[0] == alone


def test_engine_config_is_validated(target, drafter):
    with pytest.raises(ValueError, match="unknown length policy"):
        EngineConfig(target_def=target.graphdef, cache_len=CACHE, max_new_cap=CAP, greedy=True, policy="fast")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(target_def=target.graphdef, cache_len=CACHE, max_new_cap=CAP, greedy=True,
                     drafter_def=drafter.graphdef)
    with pytest.raises(ValueError, match="use_verify_head"):
        EngineConfig(target_def=target.graphdef, cache_len=CACHE, max_new_cap=CAP, greedy=True,
                     drafter_def=drafter.graphdef, block_size=H.BLOCK, use_verify_head=True)

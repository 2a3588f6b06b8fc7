"""Tree verification through `generate` and the engine: greedy output is the target's own.

Greedy tree decoding must reproduce greedy AR decoding token for token on a
ragged batch, for node budgets from 1 (an AR step) to several blocks' worth,
with a distilled drafter (long accepted paths) and an untrained one (mostly
rejections), and with a stop token that falls inside an accepted path. In the
engine, staggered requests and seeded samples behave as with chain
verification: a request's output never depends on its slot or its neighbours.
"""

import dataclasses

import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target, drafter  # noqa: F401 (fixtures)
from adaflash_jax.decoding.engine_state import EngineConfig
from adaflash_jax.errors import InputError
from test_engine import CACHE, CAP, REF_NEW, Driver, expected, mixed_requests

NEW = 40


@pytest.fixture(scope="module")
def prompts():
    return H.TEST_PROMPTS + H.random_prompts(4, seed=3)  # prompt lengths 3..14: a ragged batch


@pytest.fixture(scope="module")
def ar(target, prompts):
    return [af.generate(target, prompts[i:i + 4], max_new_tokens=NEW, stop_token_ids=()).token_ids
            for i in (0, 4)]


def tree_generate(target, drafter, prompts, budget, **kw):
    return [af.generate(target, prompts[i:i + 4], drafter=drafter, max_new_tokens=NEW, verify="tree",
                        tree_budget=budget, **kw) for i in (0, 4)]


@pytest.mark.parametrize("budget", [1, 6, 16, 40])
def test_greedy_tree_equals_ar(target, drafter, prompts, ar, budget):
    results = tree_generate(target, drafter, prompts, budget, stop_token_ids=())
    assert [r.token_ids for r in results] == ar
    stats = results[0].stats
    assert stats["verify"] == "tree" and stats["tree_budget"] == budget
    if budget == 1:
        assert stats["mean_tau"] == 1.0 and stats["drafted_step_fraction"] == 0.0
    else:  # the distilled drafter's paths are accepted several tokens deep
        assert stats["mean_tau"] > 2.0, stats["mean_tau"]
        assert stats["mean_verify_len"] == budget


def test_greedy_tree_with_untrained_drafter(target, prompts, ar):
    untrained = af.init_drafter(target, num_layers=2, block_size=H.BLOCK, seed=11)
    assert [r.token_ids for r in tree_generate(target, untrained, prompts, 16, stop_token_ids=())] == ar


def test_stop_token_inside_an_accepted_path(target, drafter, prompts, ar):
    """The stop id is a token that, without stops, was committed mid-path (not last in its step)."""
    free = tree_generate(target, drafter, prompts, 16, stop_token_ids=())[0]
    choice = None
    for row, (tokens, commits) in enumerate(zip(free.token_ids, free.stats["acceptance_lengths"])):
        ends = set(np.cumsum(commits).tolist())  # output index 0 is the prefill's token
        for k, tok in enumerate(tokens[1:], start=1):
            if tok not in tokens[:k] and k not in ends:
                choice = (row, k, tok)
                break
        if choice:
            break
    assert choice is not None
    row, k, stop = choice
    got = tree_generate(target, drafter, prompts, 16, stop_token_ids=(stop,))
    want = [af.generate(target, prompts[i:i + 4], max_new_tokens=NEW, stop_token_ids=(stop,)).token_ids
            for i in (0, 4)]
    assert [r.token_ids for r in got] == want
    assert got[0].token_ids[row] == ar[0][row][:k + 1]  # cut right after the stop token


def tree_driver(target, drafter, budget=12, **kw):
    driver = Driver(target, drafter, **kw)
    driver.cfg = dataclasses.replace(driver.cfg, verify="tree", tree_budget=budget)
    assert budget <= CACHE - (16 + CAP)  # the tests' cache has a block of headroom
    return driver


def test_engine_slots_are_independent(target, drafter, prompts):
    reference = [af.generate(target, [p], drafter=drafter, max_new_tokens=REF_NEW, stop_token_ids=(),
                             verify="tree", tree_budget=12).token_ids[0] for p in prompts]
    requests, stop = mixed_requests(prompts, reference)
    got = tree_driver(target, drafter, eos=(stop,)).serve(requests, arrivals=[0, 0, 3, 3, 5, 9, 9, 20])
    assert got == [expected(reference[i], m, stop) for i, (_, m, _) in enumerate(requests)]


def test_seeded_tree_samples_ignore_slot_and_neighbours(target, drafter, prompts):
    mine = (prompts[2], 40, {"temperature": 0.8, "seed": 7})
    alone = tree_driver(target, drafter, greedy=False).serve([mine], arrivals=[0])[0]
    others = [(prompts[i], m, {"temperature": t, "seed": s})
              for i, m, t, s in ((0, 25, 1.5, 1), (5, 40, 0.3, 2), (6, 9, 1.0, 3))]
    crowded = tree_driver(target, drafter, greedy=False).serve(others[:2] + [mine] + others[2:],
                                                               arrivals=[0, 0, 3, 5])
    assert crowded[2] == alone
    res = af.generate(target, [mine[0]], drafter=drafter, max_new_tokens=40, temperature=0.8, seed=7,
                      stop_token_ids=(), verify="tree", tree_budget=12)
    assert res.token_ids[0] == alone


@pytest.mark.parametrize("kwargs, match", [
    ({"verify": "bush"}, "verify must be"),
    ({"verify": "tree", "tree_budget": 0}, "tree_budget"),
    ({"verify": "tree", "tree_budget": 1000}, "tree_budget"),
    ({"verify": "tree", "tree_budget": 2.5}, "whole number"),
    ({"verify": "chain", "tree_budget": 8}, "verify='tree' only"),
    ({"verify": "tree", "length_policy": "head"}, "length_policy"),
    ({"verify": "tree", "verify_len": 4}, "verify_len"),
    ({"verify": "tree", "sample_drafts": True, "temperature": 0.5}, "sample_drafts"),
])
def test_generate_rejects_bad_tree_settings(target, drafter, kwargs, match):
    with pytest.raises(InputError, match=match):
        af.generate(target, [[1, 2, 3]], drafter=drafter, max_new_tokens=4, **kwargs)


def test_tree_settings_need_a_drafter(target):
    with pytest.raises(InputError, match="need a drafter"):
        af.generate(target, [[1, 2, 3]], max_new_tokens=4, verify="tree")


def test_engine_config_validates_tree_settings(target, drafter):
    base = dict(target_def=target.graphdef, cache_len=CACHE, max_new_cap=CAP, greedy=True,
                drafter_def=drafter.graphdef, block_size=H.BLOCK)
    EngineConfig(**base, verify="tree", tree_budget=8)
    for extra, match in (({"verify": "bush"}, "unknown verify mode"),
                         ({"verify": "tree"}, "tree_budget >= 1"),
                         ({"tree_budget": 8}, "leave it 0"),
                         ({"verify": "tree", "tree_budget": 8, "sample_drafts": True}, "sample_drafts")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**base, **extra)
    with pytest.raises(ValueError, match="needs a drafter"):
        EngineConfig(target_def=target.graphdef, cache_len=CACHE, max_new_cap=CAP, greedy=True, verify="tree",
                     tree_budget=4)

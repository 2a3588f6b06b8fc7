"""The drafters shipped inside the package: found by name, small, trained, lossless."""

import json
import os

import pytest

import adaflash_jax as af
from adaflash_jax.drafter_api import resolve_drafter_path

NAME = "smollm2-135m-instruct-dflash"
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "A shop sells pens at 3 dollars each. How much do 7 pens cost? Show the steps."]


@pytest.fixture(scope="module")
def drafter(smollm2):
    return af.load_drafter(NAME, target=smollm2)


def test_found_by_name_small_with_its_draft_vocabulary_and_target(drafter):
    path = resolve_drafter_path(NAME)
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    assert size <= 25 * 2**20, size
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["block_size"] == 16 and config["architectures"] == ["DFlashDraftModel"]
    assert config["adaflash_target"]["name"] == "smollm2-135m-instruct"
    assert drafter.block_size == 16 and drafter.cfg.draft_vocab_size == 8192


def test_lossless_and_as_good_as_measured_on_the_fixed_evaluation_set(smollm2, drafter):
    from adaflash_jax.eval.heldout import heldout_prompts

    prompts = heldout_prompts(smollm2, 2, domains=("code", "math"))
    ids = [p.ids for cases in prompts.values() for p in cases]
    ar = af.generate(smollm2, ids, max_new_tokens=64)
    spec = af.generate(smollm2, ids, max_new_tokens=64, drafter=drafter, verify="chain")
    assert spec.token_ids == ar.token_ids
    # A random drafter commits 1.0 tokens per verify step; this one measured 1.89 on these four
    # prompts (the drafter card's benchmark: 1.63 over all 32 at batch 1). The bound leaves 10%
    # for CPUs whose rounding flips a near-tie draft.
    assert spec.stats["mean_tau"] > 1.70, spec.stats["mean_tau"]
    # Shorter verification keeps the output identical too.
    short = af.generate(smollm2, ids[:2], max_new_tokens=48, drafter=drafter, verify_len=[4, 9])
    assert short.token_ids == [row[:48] for row in ar.token_ids[:2]]
    first, second = short.stats["acceptance_lengths"]
    assert max(first) <= 4 and max(second) <= 9  # a verify of L tokens commits at most L


ADAFLASH = "smollm2-135m-instruct-adaflash"


def test_adaflash_drafter_carries_its_head_and_recipe(smollm2):
    drafter = af.load_drafter(ADAFLASH, target=smollm2)
    assert drafter.has_length_head and drafter.block_size == 16
    assert drafter.length_head.uses_confidence  # the head reads the drafts' probabilities
    path = resolve_drafter_path(ADAFLASH)
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 25 * 2**20
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dflash_config"]["use_thresh_head_two_model"]


def test_adaflash_head_policy_is_lossless_and_verifies_less(smollm2):
    drafter = af.load_drafter(ADAFLASH, target=smollm2)
    ar = af.generate(smollm2, PROMPTS, max_new_tokens=48)
    fixed = af.generate(smollm2, PROMPTS, max_new_tokens=48, drafter=drafter, length_policy="fixed")
    head = af.generate(smollm2, PROMPTS, max_new_tokens=48, drafter=drafter, length_policy="head")
    assert fixed.token_ids == ar.token_ids and head.token_ids == ar.token_ids
    assert fixed.stats["mean_tau"] > 1.15, fixed.stats["mean_tau"]
    # the head shortens verification where little would be accepted
    assert head.stats["mean_verify_len"] < fixed.stats["mean_verify_len"] == 16

"""`generate` raises a clear error naming the prompt whose target logits went non-finite.

The poison is a NaN row of the target's embedding: a prompt holding that token has NaN
logits from its prefill on, a prompt whose greedy continuation reaches it from the step
after; the other prompts of the batch never touch it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import adaflash_jax as af
from spec_helpers import TEST_PROMPTS, target  # noqa: F401 (fixture)
from adaflash_jax.generation import NonFiniteLogitsError

IN_PROMPT_0 = 5  # appears in TEST_PROMPTS[0] only, in no greedy continuation (24 tokens)
GENERATED_BY_2 = 26  # TEST_PROMPTS[2]'s first greedy token; nothing else reaches it


def poisoned(target, token: int):
    """`target` with a NaN embedding row for `token`."""
    state = jax.tree.map(lambda x: x, target.state)
    state["embed"][...] = state["embed"][...].at[token].set(jnp.nan)
    return dataclasses.replace(target, state=state, name=f"{target.name}-nan{token}")


@pytest.mark.parametrize("token,prompt,position", [(IN_PROMPT_0, 0, 0), (GENERATED_BY_2, 2, 1)])
def test_generate_names_the_prompt_whose_logits_went_non_finite(target, token, prompt, position):
    clean = af.generate(target, TEST_PROMPTS, max_new_tokens=24, stop_token_ids=()).token_ids
    assert token not in sum((p + o for i, (p, o) in enumerate(zip(TEST_PROMPTS, clean)) if i != prompt), [])
    with pytest.raises(NonFiniteLogitsError, match=rf"prompt {prompt} \(at output token {position}\)") as info:
        af.generate(poisoned(target, token), TEST_PROMPTS, max_new_tokens=24, stop_token_ids=())
    assert info.value.prompts == [prompt]
    assert "non-finite (NaN or infinity)" in str(info.value)


def test_a_clean_target_is_unaffected(target):
    """The guard only reads logits: a finite run returns every token as before."""
    got = af.generate(target, TEST_PROMPTS, max_new_tokens=24, stop_token_ids=())
    assert all(len(t) == 24 and min(t) >= 0 for t in got.token_ids)

"""`generate` raises a clear error naming the prompt whose target logits went non-finite.

The poison is a NaN row of the target's embedding: a prompt holding that token has NaN
logits from its prefill on, a prompt whose continuation reaches it from the step after;
the other prompts of the batch never touch it. Speculative decoding must catch it in every
verification mode, greedy or sampled (sampled acceptance draws from log-probs, which would
otherwise turn NaN into arbitrary tokens), and leave the other prompts' tokens as they were:
seeded sampling with argmax drafts draws each output position with its own key, so a
prompt's tokens do not depend on its batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
import spec_helpers as H
from adaflash_jax import generation
from adaflash_jax.decoding.acceptance import stop_at_nonfinite
from adaflash_jax.decoding.sampling import NONFINITE_TOKEN
from adaflash_jax.generation import NonFiniteLogitsError
from adaflash_jax.models.length_head import LengthHead
from nonfinite_helpers import fixed_costs, poisoned
from spec_helpers import TEST_PROMPTS, target  # noqa: F401 (fixture)

IN_PROMPT_0 = 5  # appears in TEST_PROMPTS[0] only, in no greedy continuation (24 tokens)
GENERATED_BY_2 = 26  # TEST_PROMPTS[2]'s first greedy token; nothing else reaches it
MAX_NEW, SAMPLED_NEW = 24, 12
# An AR step as slow as a thousand drafted ones: the adaptive decoder drafts whenever it can.
DRAFTING_PAYS = fixed_costs(1e3)(len(TEST_PROMPTS))
MODES = {"chain": dict(verify="chain", length_policy="fixed"),
         "verify-head": dict(verify="chain", length_policy="fixed", verify_head=True),
         "head": dict(verify="chain", length_policy="head"),
         "tree": dict(verify="tree"),
         "adaptive": dict(verify="adaptive", step_costs=DRAFTING_PAYS)}


@pytest.fixture(scope="module")
def drafter():
    """The distilled drafter, with a length head for the "head" policy (other modes ignore it)."""
    return H.distilled_drafter().with_length_head(LengthHead(H.TINY.hidden_size, 16, rngs=nnx.Rngs(3)))


@pytest.mark.parametrize("token,prompt,position", [(IN_PROMPT_0, 0, 0), (GENERATED_BY_2, 2, 1)])
def test_generate_names_the_prompt_whose_logits_went_non_finite(target, token, prompt, position):
    clean = af.generate(target, TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).token_ids
    assert token not in sum((p + o for i, (p, o) in enumerate(zip(TEST_PROMPTS, clean)) if i != prompt), [])
    with pytest.raises(NonFiniteLogitsError, match=rf"prompt {prompt} \(at output token {position}\)") as info:
        af.generate(poisoned(target, token), TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=())
    assert info.value.prompts == [prompt]
    assert "non-finite (NaN or infinity)" in str(info.value)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "verify-head"])  # the verify head samples only
def test_greedy_speculative_decoding_names_the_prompt(target, drafter, mode):
    with pytest.raises(NonFiniteLogitsError, match=r"prompt 2 \(at output token 1\)") as info:
        af.generate(poisoned(target, GENERATED_BY_2), TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=(),
                    drafter=drafter, **MODES[mode])
    assert info.value.prompts == [2]


def test_sampled_acceptance_stops_at_the_first_non_finite_position():
    finite = jnp.asarray([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1]], bool)
    accepted, nxt = stop_at_nonfinite(jnp.asarray([3, 1, 2]), jnp.asarray([7, 8, 9]), finite)
    np.testing.assert_array_equal(accepted, [2, 1, 0])  # the drafts before it stand
    np.testing.assert_array_equal(nxt, [NONFINITE_TOKEN, 8, NONFINITE_TOKEN])


def only_in_one_output(outputs: list[list[int]]) -> tuple[int, int, int]:
    """(prompt i, token t, output index j): the first token that prompt i's output emits at j,
    before its last position, and that no prompt and no other output holds."""
    for i, out in enumerate(outputs):
        elsewhere = set(TEST_PROMPTS[i]).union(
            *(p + o for k, (p, o) in enumerate(zip(TEST_PROMPTS, outputs)) if k != i))
        for j, token in enumerate(out[:-1]):
            if token not in elsewhere:
                return i, token, j
    raise AssertionError(f"every output token is shared: {outputs}")


@pytest.mark.parametrize("mode", MODES)
def test_sampled_verification_stops_the_poisoned_prompt_only(target, drafter, mode, monkeypatch):
    """The poisoned prompt emits its tokens up to the poisoned one, then the non-finite
    marker; the others emit exactly their tokens of a clean run."""
    kw = dict(max_new_tokens=SAMPLED_NEW, stop_token_ids=(), temperature=0.5, seed=4, drafter=drafter,
              **MODES[mode])
    clean = af.generate(target, TEST_PROMPTS, **kw).token_ids
    prompt, token, index = only_in_one_output(clean)
    seen = []
    check = generation._check_finite
    monkeypatch.setattr(generation, "_check_finite", lambda ids: (seen.append(ids), check(ids)))
    with pytest.raises(NonFiniteLogitsError, match=rf"prompt {prompt} \(at output token {index + 1}\)") as info:
        af.generate(poisoned(target, token), TEST_PROMPTS, **kw)
    assert info.value.prompts == [prompt]
    want = [out if i != prompt else out[:index + 1] + [NONFINITE_TOKEN] for i, out in enumerate(clean)]
    assert seen == [want]


def test_a_clean_target_is_unaffected(target):
    """The guard only reads logits: a finite run returns every token as before."""
    got = af.generate(target, TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=())
    assert all(len(t) == MAX_NEW and min(t) >= 0 for t in got.token_ids)

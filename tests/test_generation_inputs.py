"""`generate` refuses non-finite and malformed numbers, and reports bad input as InputError."""

import math

import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.errors import InputError
from adaflash_jax.generation import check_numbers

PROMPTS = [[5, 17, 3]]


@pytest.fixture(scope="module")
def drafter(target):
    return af.init_drafter(target, num_layers=2, block_size=8)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(rho=math.nan), "rho must be finite"),
    (dict(rho=math.inf), "rho must be finite"),
    (dict(min_len=math.nan), "min_len must be finite"),
    (dict(min_len=1.5), "min_len must be a whole number"),
    (dict(probe_every=math.inf), "probe_every must be finite"),
    (dict(temperature=math.inf), "temperature must be finite"),
    (dict(top_p=math.nan), "top_p must be finite"),
    (dict(max_new_tokens=math.nan), "max_new_tokens must be finite"),
    (dict(seed="x"), "seed must be a number"),
])
def test_non_finite_and_malformed_numbers_are_refused(target, drafter, kwargs, needle):
    with pytest.raises(InputError, match=needle):
        af.generate(target, PROMPTS, drafter=drafter, **kwargs)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(block_size=1), "block_size"),
    (dict(verify_len=99), "verify_len"),
    (dict(length_policy="bogus"), "length_policy"),
])
def test_argument_checks_raise_input_error(target, drafter, kwargs, needle):
    with pytest.raises(InputError, match=needle):
        af.generate(target, PROMPTS, drafter=drafter, **kwargs)


def test_prompt_checks_raise_input_error(target):
    with pytest.raises(InputError, match="empty"):
        af.generate(target, [[]])
    with pytest.raises(InputError, match="longer than the maximum"):
        af.generate(target, [[1] * 600])


def test_check_numbers_accepts_finite_values():
    check_numbers(rho=1.3, min_len=2.0, temperature=0.0, top_p=1.0, seed=None)

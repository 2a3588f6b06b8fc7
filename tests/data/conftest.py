"""Shared fixtures for the data tests: the SmolLM2 tokenizer and two small prompt-set builds."""

import pytest

from adaflash_jax.checkpoints.gguf import smollm2_gguf_path
from adaflash_jax.checkpoints.tokenizer import Tokenizer
from adaflash_jax.data import build_prompt_datasets

SMALL_SIZES = {"train": 48, "eval": 12}


@pytest.fixture(scope="session")
def tokenizer():
    return Tokenizer.from_gguf(smollm2_gguf_path())


def _small_build(tmp_path_factory, name):
    data_dir = tmp_path_factory.mktemp(name)
    counts = build_prompt_datasets(data_dir, train_size=SMALL_SIZES["train"], eval_size=SMALL_SIZES["eval"])
    return data_dir, counts


@pytest.fixture(scope="session")
def small_sizes():
    return dict(SMALL_SIZES)


@pytest.fixture(scope="session")
def small_build(tmp_path_factory):
    """(data_dir, counts) of every domain built with small sizes."""
    return _small_build(tmp_path_factory, "prompts_a")


@pytest.fixture(scope="session")
def second_small_build(tmp_path_factory):
    """The same small build again, in another directory."""
    return _small_build(tmp_path_factory, "prompts_b")

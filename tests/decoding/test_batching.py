"""Prompt validation and bucket padding (bounded set of compiled shapes)."""

import numpy as np
import pytest

from adaflash_jax.decoding.batching import bucket, pad_batch, trim_outputs, validate_prompts


@pytest.mark.parametrize("n,minimum,expected", [(1, 1, 1), (3, 1, 4), (4, 1, 4), (5, 16, 16),
                                                (17, 16, 32), (64, 64, 64), (0, 1, 1)])
def test_bucket(n, minimum, expected):
    assert bucket(n, minimum) == expected


def test_pad_batch_right_pads_into_buckets():
    batch = pad_batch([[5, 6, 7], [8] * 20, [9]], max_prompt_len=100)
    assert batch.tokens.shape == (4, 32) and batch.tokens.dtype == np.int32
    assert batch.lengths.tolist() == [3, 20, 1, 1]
    assert batch.active.tolist() == [True, True, True, False]
    assert batch.tokens[0, :4].tolist() == [5, 6, 7, 0] and batch.tokens[3].sum() == 0
    assert batch.num_prompts == 3 and batch.batch == 4 and batch.prompt_len == 32


def test_pad_batch_caps_bucket_at_the_limit():
    batch = pad_batch([[1] * 40], max_prompt_len=50)
    assert batch.prompt_len == 50  # the 64 bucket would pass the model's context
    with pytest.raises(ValueError, match="51 tokens is longer than the maximum of 50"):
        pad_batch([[1] * 51], max_prompt_len=50)


@pytest.mark.parametrize("prompts,match", [
    ([], "non-empty list"),
    ("abc", "non-empty list"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, -1]], r"prompt 0 has token ids outside the vocabulary \[0, 10\): \[-1\]"),
    ([[3], [10, 2, 11]], r"prompt 1 .*\[10, 11\]"),
])
def test_validate_prompts_errors(prompts, match):
    with pytest.raises(ValueError, match=match):
        validate_prompts(prompts, vocab_size=10)


def test_validate_prompts_normalises_to_int_lists():
    out = validate_prompts([np.asarray([1, 2], np.int64), (3,)], vocab_size=10)
    assert out == [[1, 2], [3]] and all(type(t) is int for t in out[0])


def test_trim_outputs():
    out = np.arange(12).reshape(3, 4)
    assert trim_outputs(out, np.asarray([2, 4, 1]), 2) == [[0, 1], [4, 5, 6, 7]]

"""Rollout prompt selection: train splits only, round-robin over domains, seeded, length-capped."""

import pytest

from adaflash_jax.data import load_prompts
from adaflash_jax.training.rollout_job import interleaved_prompts

DOMAINS = ("code", "math", "prose")


def test_round_robin_from_train_splits_only(small_build):
    data_dir, _ = small_build
    texts, labels = interleaved_prompts(data_dir, DOMAINS, per_domain=5, seed=0)
    assert labels == list(DOMAINS) * 5  # any prefix of the job is balanced
    for domain in DOMAINS:
        train = {r["prompt"].decode() for r in load_prompts(domain, "train", data_dir=data_dir)}
        evals = {r["prompt"].decode() for r in load_prompts(domain, "eval", data_dir=data_dir)}
        mine = [t for t, d in zip(texts, labels) if d == domain]
        assert len(set(mine)) == 5 and set(mine) <= train and not set(mine) & evals
    assert interleaved_prompts(data_dir, DOMAINS, per_domain=5, seed=0) == (texts, labels)
    other, _ = interleaved_prompts(data_dir, DOMAINS, per_domain=5, seed=1)
    assert other != texts


def test_encoding_skips_prompts_over_the_cap(small_build):
    data_dir, _ = small_build
    encode = lambda text: list(range(len(text) // 100 + 1))  # noqa: E731  (a length proxy)
    ids, labels = interleaved_prompts(data_dir, DOMAINS, per_domain=4, seed=0, encode=encode,
                                      max_prompt_tokens=8)
    assert len(ids) == 12 and all(len(p) <= 8 for p in ids)
    with pytest.raises(ValueError, match="only .* train prompts within max_prompt_tokens=1"):
        interleaved_prompts(data_dir, DOMAINS, per_domain=4, seed=0, encode=encode, max_prompt_tokens=1)


@pytest.mark.parametrize("domains, per_domain, needle", [
    (("humaneval",), 2, "trainable domains only"),
    (("poetry",), 2, "trainable domains only|unknown prompt domain"),
    (("math",), 0, "per_domain must be >= 1"),
    (("math",), 10_000, "fewer than per_domain"),
])
def test_bad_requests_are_refused(small_build, domains, per_domain, needle):
    with pytest.raises(ValueError, match=needle):
        interleaved_prompts(small_build[0], domains, per_domain=per_domain, seed=0)

"""Autoregressive `af.generate` on a tiny random target: batching, stop tokens, budgets."""

import numpy as np
import pytest

import adaflash_jax as af
from fixtures import tiny_config, tiny_target

PROMPT_LENS = (3, 17, 9, 30, 1)
MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return tiny_target(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def prompts(target):
    rng = np.random.default_rng(1)
    return [rng.integers(3, target.cfg.vocab_size, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def alone(target, prompts):
    """Each prompt decoded on its own, with no stop tokens."""
    return [af.generate(target, [p], max_new_tokens=MAX_NEW, stop_token_ids=[]).token_ids[0]
            for p in prompts]


def test_batch_equals_each_prompt_alone(target, prompts, alone):
    res = af.generate(target, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert res.token_ids == alone
    assert all(len(t) == MAX_NEW for t in alone)
    assert res.stats["padded_batch"] == 8 and res.stats["prompt_bucket"] == 32
    assert res.texts is None  # no tokenizer


def test_greedy_follows_score_argmax(target, prompts, alone):
    """Each greedy token is the argmax of the full forward over prompt + previous tokens."""
    for p, out in zip(prompts[:2], alone[:2]):
        logits = target.score([p + out[:-1]])[0]
        assert np.argmax(logits[len(p) - 1:], axis=-1).tolist() == out


def first_new_token(seq, start=1):
    """(index, token) of the first token at index >= start not seen before it."""
    for i in range(start, len(seq)):
        if seq[i] not in seq[:i]:
            return i, seq[i]
    raise AssertionError(f"no fresh token in {seq}")


def test_stops_at_stop_token_inclusive(target, prompts, alone):
    k, stop = first_new_token(alone[1], start=2)
    res = af.generate(target, [prompts[1]], max_new_tokens=MAX_NEW, stop_token_ids=[stop])
    assert res.token_ids == [alone[1][:k + 1]]
    # A stop token emitted first ends the sequence after one token.
    res = af.generate(target, [prompts[1]], max_new_tokens=MAX_NEW, stop_token_ids=[alone[1][0]])
    assert res.token_ids == [alone[1][:1]]


def test_config_eos_stops_one_row_only(target, prompts, alone):
    """A row that hits EOS stops; the other rows decode exactly as before."""
    k, stop = first_new_token(alone[0], start=2)
    cfg = target.cfg.replace(eos_token_ids=(stop,))
    with_eos = tiny_target(cfg, seed=0)
    res = af.generate(with_eos, prompts, max_new_tokens=MAX_NEW)
    assert res.token_ids[0] == alone[0][:k + 1]
    for got, ref in zip(res.token_ids[1:], alone[1:]):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert got == ref[:cut]
    assert res.stats["new_tokens"] == sum(len(t) for t in res.token_ids)


@pytest.mark.parametrize("max_new", [1, 2, 7, 16, 17])
def test_never_exceeds_max_new_tokens(target, prompts, alone, max_new):
    res = af.generate(target, prompts[:3], max_new_tokens=max_new, stop_token_ids=[])
    assert [len(t) for t in res.token_ids] == [max_new] * 3
    assert res.token_ids == [a[:max_new] for a in alone[:3]]
    assert res.stats["steps"] <= max_new


def test_token_id_prompts_accept_numpy_and_tuples(target, prompts, alone):
    res = af.generate(target, [np.asarray(prompts[0]), tuple(prompts[2])], max_new_tokens=MAX_NEW,
                      stop_token_ids=[])
    assert res.token_ids == [alone[0], alone[2]]

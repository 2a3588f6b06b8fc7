"""Greedy speculative decoding must be token-identical to greedy AR decoding.

A random drafter (drafts nearly always rejected) checks the reject/rollback
path; a distilled drafter (most of each block accepted) checks the accept
path, EOS and max_new_tokens inside an accepted block, shorter blocks and
shorter verify lengths. All runs share one compiled shape per block size.
"""

import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target, drafter  # noqa: F401 (fixtures)

MAX_NEW = 60  # max_new cap 64, shared with the distillation data


@pytest.fixture(scope="module")
def ar(target):
    return af.generate(target, H.TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).token_ids


@pytest.fixture(scope="module")
def spec16(target, drafter):
    return af.generate(target, H.TEST_PROMPTS, drafter=drafter, max_new_tokens=MAX_NEW,
                       stop_token_ids=(), verify="chain")


def spec(target, drafter, prompts=H.TEST_PROMPTS, **kw):
    kw.setdefault("stop_token_ids", ())
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("verify", "chain")  # this file tests chain verification (the default is adaptive)
    return af.generate(target, prompts, drafter=drafter, **kw)


def check_stats(res):
    """Per-step commits add up to the emitted tokens (the first comes from the prefill)."""
    for toks, lens in zip(res.token_ids, res.stats["acceptance_lengths"]):
        assert sum(lens) == len(toks) - 1
        assert all(n >= 1 for n in lens)


def step_spans(lens):
    """Output index ranges [start, end) committed by each verify step."""
    ends = 1 + np.cumsum(lens)
    return list(zip(ends - np.asarray(lens), ends))


def test_random_drafter_matches_ar(target, ar):
    res = spec(target, af.init_drafter(target, num_layers=2, block_size=H.BLOCK, seed=5))
    assert res.token_ids == ar
    check_stats(res)
    assert res.stats["mean_tau"] < 1.3  # almost every draft rejected: the rollback path


def test_distilled_drafter_matches_ar_with_high_acceptance(ar, spec16):
    assert spec16.token_ids == ar
    assert all(len(t) == MAX_NEW for t in ar)
    check_stats(spec16)
    assert spec16.stats["mean_tau"] >= 4.0, spec16.stats["acceptance_lengths"]
    # whole blocks accepted: every draft and the token after the last one commit
    assert max(max(lens) for lens in spec16.stats["acceptance_lengths"]) == H.BLOCK


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_block_and_verify_lengths_match_ar(target, drafter, ar, block_size):
    short = max(1, block_size // 2)
    per_prompt = [1, 2, block_size - 1, block_size]
    for verify_len in (None, short, per_prompt):
        res = spec(target, drafter, block_size=block_size, verify_len=verify_len)
        assert res.token_ids == ar, (block_size, verify_len)
        check_stats(res)
        limits = np.broadcast_to(block_size if verify_len is None else verify_len, (4,))
        for lens, cap in zip(res.stats["acceptance_lengths"], limits):
            # a step commits at most verify_len tokens, and the cap is reached
            assert max(lens) == cap, (block_size, verify_len, lens)
        assert res.stats["block_size"] == block_size


def test_uneven_batch_with_padding_row(target, drafter, ar):
    order = [2, 0, 1]  # 3 prompts pad to 4 rows; lengths 10, 3, 6
    res = spec(target, drafter, prompts=[H.TEST_PROMPTS[i] for i in order])
    assert res.token_ids == [ar[i] for i in order]


def test_max_new_tokens_inside_a_block(target, drafter, ar, spec16):
    # stop in the middle of a long accepted block (past 32, to keep the max_new cap of 64)
    cuts = [(row, s + (e - s) // 2) for row, lens in enumerate(spec16.stats["acceptance_lengths"])
            for s, e in step_spans(lens) if e - s >= 3 and s + (e - s) // 2 > 32]
    assert cuts
    row, max_new = cuts[0]
    for n in (max_new, MAX_NEW - 1):
        res = spec(target, drafter, max_new_tokens=n)
        assert res.token_ids == [t[:n] for t in ar]
        check_stats(res)
        if n == max_new:
            full, got = spec16.stats["acceptance_lengths"][row], res.stats["acceptance_lengths"][row]
            assert got[:-1] == full[:len(got) - 1]
            assert got[-1] < full[len(got) - 1]  # the last block really was cut


def test_stop_token_inside_an_accepted_block(target, drafter, ar, spec16):
    # a token whose first occurrence is an accepted draft (not a step's last token)
    choice = None
    for row, (toks, lens) in enumerate(zip(ar, spec16.stats["acceptance_lengths"])):
        for start, end in step_spans(lens):
            for j in range(start, end - 1):
                if toks[j] not in toks[:j]:
                    choice = (row, j, toks[j])
                    break
            if choice:
                break
        if choice:
            break
    assert choice is not None
    row, j, stop = choice
    expected = [t[:t.index(stop) + 1] if stop in t else t for t in ar]
    assert expected[row] == ar[row][:j + 1]
    ar_stop = af.generate(target, H.TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[stop])
    assert ar_stop.token_ids == expected
    res = spec(target, drafter, stop_token_ids=[stop])
    assert res.token_ids == expected
    check_stats(res)
    full, got = spec16.stats["acceptance_lengths"][row], res.stats["acceptance_lengths"][row]
    assert got[-1] < full[len(got) - 1]  # stopped mid-block, after accepted drafts

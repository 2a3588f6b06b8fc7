"""Reduced draft vocabulary: the d2t table, its checkpoint round trip, and lossless decoding.

The reduced drafter is the distilled tiny drafter restricted to the 20 most frequent
tokens of its trajectories: the other 12 target tokens can never be drafted, so
blocks that need them are cut short, yet greedy output must stay the target's own.
"""

import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from adaflash_jax.checkpoints import drafter_hf
from adaflash_jax.models import draft_vocab

MAX_NEW = 60


def test_frequent_tokens_by_count_then_id_with_forced_ids():
    data = [np.array([5, 5, 5, 7, 7, 9, 3]), np.array([9, 9, 9, 2])]
    # counts: 9 -> 4, 5 -> 3, 7 -> 2, 3 -> 1, 2 -> 1
    assert draft_vocab.frequent_tokens(data, 10, 3).tolist() == [5, 7, 9]
    assert draft_vocab.frequent_tokens(data, 10, 4).tolist() == [2, 5, 7, 9]  # tie 2 vs 3: smaller id
    assert draft_vocab.frequent_tokens(data, 10, 3, always=[0]).tolist() == [0, 5, 9]
    assert draft_vocab.coverage([5, 7, 9], data) == pytest.approx(9 / 11)


@pytest.mark.parametrize("table, message", [([3, 3, 4], "ascending"), ([1, 40], "outside"),
                                            ([[1, 2]], "1-D")])
def test_bad_d2t_tables_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        draft_vocab.check_d2t(table, 32)


def test_mapping_round_trip():
    drafter = H.reduced_vocab_drafter().module
    d2t = np.asarray(drafter.d2t[...])
    ids = np.arange(H.TINY.vocab_size)
    idx = np.asarray(draft_vocab.to_draft(drafter, ids))
    inside = np.isin(ids, d2t)
    assert np.all(idx[~inside] == -1)
    assert np.array_equal(np.asarray(draft_vocab.to_target(drafter, idx[inside])), ids[inside])


def test_save_load_round_trip_keeps_table_and_logits(tmp_path):
    target, reduced = H.tiny_target(), H.reduced_vocab_drafter()
    af.save_drafter(reduced, str(tmp_path / "d"), dtype="float32")
    loaded = af.load_drafter(str(tmp_path / "d"), target=target)
    assert loaded.cfg.draft_vocab_size == 20
    assert np.array_equal(np.asarray(loaded.module.d2t[...]), np.asarray(reduced.module.d2t[...]))
    ids = [H.TEST_PROMPTS[1]]
    a, b = af.draft_logits(target, reduced, ids), af.draft_logits(target, loaded, ids)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    outside = ~np.isin(np.arange(H.TINY.vocab_size), np.asarray(reduced.module.d2t[...]))
    assert np.all(np.isneginf(a[..., outside]))  # never proposes a token outside the table


def test_checkpoint_with_inconsistent_tables_is_refused(tmp_path):
    cfg = H.reduced_vocab_drafter().cfg
    tensors = drafter_hf.draft_vocab_to_hf(np.asarray(H.reduced_vocab_drafter().module.d2t[...]), cfg)
    tensors["t2d"] = ~tensors["t2d"]
    with pytest.raises(ValueError, match="t2d"):
        drafter_hf.draft_vocab_from_hf(tensors, cfg)
    with pytest.raises(ValueError, match="no d2t"):
        drafter_hf.draft_vocab_from_hf({}, cfg)


def test_greedy_decoding_with_reduced_vocabulary_is_lossless():
    target = H.tiny_target()
    ar = af.generate(target, H.TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=())
    full = af.generate(target, H.TEST_PROMPTS, drafter=H.distilled_drafter(), max_new_tokens=MAX_NEW,
                       stop_token_ids=(), verify="chain")
    reduced = af.generate(target, H.TEST_PROMPTS, drafter=H.reduced_vocab_drafter(),
                          max_new_tokens=MAX_NEW, stop_token_ids=(), verify="chain")
    assert reduced.token_ids == ar.token_ids
    # drafting still pays where the trajectory stays inside the table, less than with all tokens
    assert 1.5 < reduced.stats["mean_tau"] <= full.stats["mean_tau"]

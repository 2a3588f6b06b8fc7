"""Anchors, the DFlash block mask and the decayed loss against direct constructions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.training import anchors as blocks
from adaflash_jax.training.losses import acceptance_metrics, combine_counts, decayed_cross_entropy


def test_anchors_inside_responses_distinct_and_sorted():
    prompt_lens = jnp.array([3, 10, 5])
    seq_lens = jnp.array([20, 14, 6])
    a, valid = blocks.sample_anchors(jax.random.key(0), prompt_lens, seq_lens, seq_len=24,
                                     num_blocks=5)
    a, valid = np.asarray(a), np.asarray(valid)
    for row in range(3):
        lo, hi = int(prompt_lens[row]), int(seq_lens[row]) - 2
        chosen = a[row][valid[row]]
        assert len(chosen) == min(5, max(hi - lo + 1, 0))
        assert np.all((chosen >= lo) & (chosen <= hi))
        assert len(set(chosen.tolist())) == len(chosen)
        assert np.all(np.diff(chosen) > 0)
    # Row 2 has candidates {5..4}: none; every block is invalid.
    assert not valid[2].any()


def test_anchors_cover_the_range_uniformly():
    counts = np.zeros(16)
    for s in range(300):
        a, v = blocks.sample_anchors(jax.random.key(s), jnp.array([4]), jnp.array([14]),
                                     seq_len=16, num_blocks=2)
        for x in np.asarray(a)[0][np.asarray(v)[0]]:
            counts[x] += 1
    inside = counts[4:13]
    assert counts[:4].sum() == 0 and counts[13:].sum() == 0
    assert inside.min() > 0.6 * inside.mean()


def test_block_inputs_and_labels():
    tokens = jnp.arange(100, 120)[None]  # token value = 100 + position
    anchors = jnp.array([[3, 9]])
    blk, pos, labels, label_pos = blocks.block_inputs(tokens, anchors, block_size=4, mask_token_id=7)
    assert blk.tolist() == [[103, 7, 7, 7, 109, 7, 7, 7]]
    assert pos.tolist() == [[3, 4, 5, 6, 9, 10, 11, 12]]
    assert labels.tolist() == [[[103, 104, 105, 106], [109, 110, 111, 112]]]
    assert np.array_equal(np.asarray(label_pos), np.asarray(pos).reshape(1, 2, 4))


def test_block_mask_matches_direct_construction():
    anchors = jnp.array([[2, 5, 6]])
    t, bs = 8, 3
    mask = np.asarray(blocks.block_attention_mask(anchors, seq_len=t, block_size=bs))[0]
    expect = np.zeros((3 * bs, t + 3 * bs), bool)
    for n, a in enumerate([2, 5, 6]):
        for q in range(bs):
            row = n * bs + q
            expect[row, :a] = True  # context strictly before the anchor
            expect[row, t + n * bs: t + (n + 1) * bs] = True  # own block, both directions
    assert np.array_equal(mask, expect)


def test_no_label_leaks_into_inputs():
    """A block's inputs carry only its anchor; every label is masked or is context the block
    may not see (positions >= anchor are outside its context)."""
    tokens = jnp.arange(50)[None]
    anchors = jnp.array([[10, 30]])
    blk, _, labels, label_pos = blocks.block_inputs(tokens, anchors, block_size=4, mask_token_id=999)
    mask = np.asarray(blocks.block_attention_mask(anchors, seq_len=50, block_size=4))[0]
    blk = np.asarray(blk)[0].reshape(2, 4)
    assert (blk[:, 1:] == 999).all()
    for n in range(2):
        ctx_visible = np.nonzero(mask[n * 4, :50])[0]
        assert ctx_visible.max() < int(anchors[0, n])
        assert set(np.asarray(label_pos)[0, n].tolist()).isdisjoint(ctx_visible.tolist())


def test_position_weights():
    w = np.asarray(blocks.position_weights(16, 7.0))
    assert w[0] == 0.0 and w[1] == pytest.approx(1.0)
    assert w[8] == pytest.approx(np.exp(-1.0), rel=1e-6)
    assert blocks.default_gamma(16) == 7 and blocks.default_gamma(10) == 5
    assert blocks.default_gamma(8) == 4


def test_decayed_cross_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 4, 11)).astype(np.float32)
    labels = rng.integers(0, 11, size=(2, 3, 4))
    valid = rng.random((2, 3, 4)) > 0.3
    w = np.asarray(blocks.position_weights(4, 4.0))
    loss, _ = decayed_cross_entropy(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(valid),
                                    jnp.asarray(w))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    ww = w[None, None] * valid
    assert float(loss) == pytest.approx(float((ww * nll).sum() / ww.sum()), rel=1e-5)


def test_teacher_forced_tau_counts_leading_hits():
    v = 5
    labels = jnp.array([[[0, 1, 2, 3], [0, 4, 4, 4]]])
    preds = np.array([[[0, 1, 2, 0], [0, 0, 4, 4]]])  # block 0: 2 hits; block 1: 0 hits
    logits = jax.nn.one_hot(jnp.asarray(preds), v) * 10.0
    valid = jnp.ones((1, 2, 4), bool)
    m = acceptance_metrics(logits, labels, valid)
    assert float(m["tau_teacher_forced"]) == pytest.approx(((2 + 1) + (0 + 1)) / 2)
    short = valid.at[0, 0, 2:].set(False)  # sequence ends after offset 1
    m = acceptance_metrics(logits, labels, short)
    assert float(m["tau_teacher_forced"]) == pytest.approx(((1 + 1) + (0 + 1)) / 2)


def test_metrics_of_chunks_combine_exactly():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(6, 3, 5, 4)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 4, size=(6, 3, 5)))
    valid = jnp.asarray(rng.random((6, 3, 5)) < 0.8)
    whole = acceptance_metrics(logits, labels, valid)
    parts = combine_counts([jax.device_get(acceptance_metrics(logits[a:b], labels[a:b], valid[a:b])["counts"])
                            for a, b in ((0, 1), (1, 4), (4, 6))])
    assert parts["tau_teacher_forced"] == pytest.approx(float(whole["tau_teacher_forced"]), rel=1e-6)
    assert parts["accuracy"] == pytest.approx(float(whole["accuracy"]), rel=1e-6)
    np.testing.assert_allclose(parts["accuracy_per_position"], whole["accuracy_per_position"], rtol=1e-6)

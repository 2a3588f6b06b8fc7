"""Cached target features computed length-sorted at trimmed widths equal the full-width ones."""

import numpy as np

from adaflash_jax.training import features


def test_trimmed_widths_match_full_width_features(tiny_train_env, monkeypatch):
    monkeypatch.setattr(features, "WIDTH_BUCKET", 16)
    target = tiny_train_env.target
    tokens = np.asarray(tiny_train_env.arrays["tokens"][:10], np.int32)
    lens = np.asarray([64, 20, 33, 9, 64, 17, 48, 30, 12, 40])
    full = np.zeros(tokens.shape + (target.cfg.hidden_size,), np.float32)
    trimmed = np.full_like(full, np.nan)
    features.compute_features(target, tokens, (1,), full, chunk=4, progress=False)
    features.compute_features(target, tokens, (1,), trimmed, chunk=4, progress=False, seq_lens=lens)
    for row, n in enumerate(lens):
        np.testing.assert_allclose(trimmed[row, :n], full[row, :n], rtol=1e-5, atol=1e-5)
        assert np.all(np.isfinite(trimmed[row]))  # every row written, zeros past the width

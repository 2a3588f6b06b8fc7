"""Cached target features computed length-sorted at trimmed widths equal the full-width ones; data.max_rows."""

import numpy as np
import pytest

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


def test_max_rows_trains_on_a_prefix_of_the_data(tiny_train_env, tmp_path):
    from adaflash_jax.training.data import build_data

    n = len(tiny_train_env.arrays["tokens"])
    cfg = tiny_train_env.config(tmp_path / "run", f"data.max_rows={n - 5}", "data.eval_sequences=0")
    it, _ = build_data(cfg, tiny_train_env.target)
    assert len(it.tokens) == n - 5
    with pytest.raises(ValueError, match=f"data.max_rows={n + 1} but .* holds {n} rows"):
        build_data(tiny_train_env.config(tmp_path / "run", f"data.max_rows={n + 1}"), tiny_train_env.target)

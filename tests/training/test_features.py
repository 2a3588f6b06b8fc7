"""Cached target features computed length-sorted at trimmed widths equal the full-width ones; a
stopped build resumes where it was; data.max_rows."""

import json

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


def test_a_stopped_build_resumes_where_it_was(tiny_train_env, tmp_path, monkeypatch):
    target = tiny_train_env.target
    tokens = np.asarray(tiny_train_env.arrays["tokens"][:10], np.int32)
    lens = np.asarray([64, 20, 33, 9, 64, 17, 48, 30, 12, 40])
    whole = features.cached_features(target, tokens, lens, (1,), str(tmp_path / "whole"), chunk=2, progress=False)
    monkeypatch.setattr(features, "PROGRESS_EVERY_S", 0.0)  # record after every chunk
    real, calls = features._features, []

    def counted(*args, stop_at=None, **kwargs):
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt  # stopped in the middle of the third chunk
        return real(*args, **kwargs)

    cache = tmp_path / "run"
    monkeypatch.setattr(features, "_features", lambda *a, **k: counted(*a, stop_at=3, **k))
    with pytest.raises(KeyboardInterrupt):
        features.cached_features(target, tokens, lens, (1,), str(cache), chunk=2, progress=False)
    assert json.loads((cache / "features.partial.json").read_text())["rows_done"] == 4
    assert not (cache / "features.npy").exists()
    # Other data never resumes, nor overwrites, the partial build.
    with pytest.raises(ValueError, match="partial feature cache .* other data"):
        features.cached_features(target, tokens[:, ::-1].copy(), lens, (1,), str(cache), progress=False)
    calls.clear()
    monkeypatch.setattr(features, "_features", counted)
    resumed = features.cached_features(target, tokens, lens, (1,), str(cache), chunk=2, progress=False)
    assert len(calls) == 3  # only the 6 rows not yet written, 2 a chunk
    np.testing.assert_array_equal(resumed, whole)
    assert sorted(p.name for p in cache.iterdir()) == ["features.json", "features.npy"]


def test_max_rows_trains_on_a_prefix_of_the_data(tiny_train_env, tmp_path):
    from adaflash_jax.training.data import build_data

    n = len(tiny_train_env.arrays["tokens"])
    cfg = tiny_train_env.config(tmp_path / "run", f"data.max_rows={n - 5}", "data.eval_sequences=0")
    it, _ = build_data(cfg, tiny_train_env.target)
    assert len(it.tokens) == n - 5
    with pytest.raises(ValueError, match=f"data.max_rows={n + 1} but .* holds {n} rows"):
        build_data(tiny_train_env.config(tmp_path / "run", f"data.max_rows={n + 1}"), tiny_train_env.target)

"""Packed verification forward equals the padded [B, Bs] forward at every verified position.

The cache is prefilled to ragged lengths and rows verify 0, 1, some or all Bs
tokens, as rows of a speculative batch do; padding the buffer to a larger bucket
must change nothing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.decoding import autoregressive
from adaflash_jax.models.packed_layout import pack, pack_layout, unpack
from adaflash_jax.models import layers
from adaflash_jax.models.kv_cache import write_packed
from fixtures import tiny_config, tiny_target

BS = 4
CACHE_LEN = 20
PROMPT_LENS = [5, 9, 3, 7, 2]
VERIFY_LENS = [0, 1, 4, 2, 4]
FEATURE_LAYERS = (1, 0)
ATOL = 1e-5


@functools.partial(jax.jit, static_argnums=0)
def prefilled(graphdef, state, prompts, lengths):
    model = nnx.merge(graphdef, state)
    cache = autoregressive.new_cache(model, prompts.shape[0], CACHE_LEN)
    return autoregressive.prefill(model, prompts, lengths, cache)[2]


@functools.partial(jax.jit, static_argnums=0)
def padded_forward(graphdef, state, block, cache):
    out = nnx.merge(graphdef, state)(block, cache=cache, feature_layers=FEATURE_LAYERS)
    return out.hidden, out.features, out.cache


@functools.partial(jax.jit, static_argnums=(0, 5))
def packed_forward(graphdef, state, block, lengths, cache, num_slots):
    layout = pack_layout(lengths, num_slots, block.shape[1])
    out = nnx.merge(graphdef, state).packed_forward(pack(block, layout), layout, cache,
                                                    feature_layers=FEATURE_LAYERS)
    return out.hidden, out.features, out.cache, layout


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request):
    cfg = tiny_config(num_layers=2) if request.param == "llama" else \
        tiny_config(num_layers=2, qk_norm=True, tie_embeddings=True)
    target = tiny_target(cfg, seed=3)
    rng = np.random.default_rng(1)
    b = len(PROMPT_LENS)
    prompts = rng.integers(3, cfg.vocab_size, (b, max(PROMPT_LENS))).astype(np.int32)
    cache = prefilled(target.graphdef, target.state, jnp.asarray(prompts), jnp.asarray(PROMPT_LENS))
    block = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, BS)).astype(np.int32))
    lengths = jnp.asarray(VERIFY_LENS, jnp.int32)
    ref = padded_forward(target.graphdef, target.state, block, cache)
    tight = packed_forward(target.graphdef, target.state, block, lengths, cache, sum(VERIFY_LENS))
    loose = packed_forward(target.graphdef, target.state, block, lengths, cache, b * BS)
    return dict(cache=cache, ref=ref, tight=tight, loose=loose)


def verified_mask():
    return np.arange(BS)[None] < np.asarray(VERIFY_LENS)[:, None]  # [B, Bs]


def test_hidden_and_features_match_padded_forward(case):
    ref_hidden, ref_feats, _ = case["ref"]
    hidden, feats, _, layout = case["tight"]
    assert hidden.shape == (sum(VERIFY_LENS), ref_hidden.shape[-1])
    assert feats.shape == (sum(VERIFY_LENS), len(FEATURE_LAYERS) * ref_hidden.shape[-1])
    keep = verified_mask()
    for got, want in [(hidden, ref_hidden), (feats, ref_feats)]:
        got = np.asarray(unpack(got, layout, BS))
        np.testing.assert_allclose(got[keep], np.asarray(want)[keep], rtol=0, atol=ATOL)


def test_cache_written_at_verified_positions_only(case):
    base, (_, _, ref_cache) = case["cache"], case["ref"]
    written = case["tight"][2]
    assert np.asarray(written.lengths).tolist() == PROMPT_LENS  # writing never commits
    touched = np.zeros((len(PROMPT_LENS), CACHE_LEN), bool)
    for b, (start, n) in enumerate(zip(PROMPT_LENS, VERIFY_LENS)):
        touched[b, start:start + n] = True
    for name in ("k", "v"):
        got, ref, old = (np.moveaxis(np.asarray(getattr(c, name)), 3, 2)  # [L, B, S, Hkv, Dh]
                         for c in (written, ref_cache, base))
        np.testing.assert_allclose(got[:, touched], ref[:, touched], rtol=0, atol=ATOL)
        np.testing.assert_array_equal(got[:, ~touched], old[:, ~touched])


def test_padding_to_a_larger_bucket_changes_nothing(case):
    """Same values at the valid slots (XLA's CPU matmuls block by row count, so a longer
    buffer may round differently in the last bit) and not one padding write."""
    n = sum(VERIFY_LENS)
    tight_hidden, tight_feats, tight_cache, _ = case["tight"]
    hidden, feats, cache, layout = case["loose"]
    assert not np.asarray(layout.valid)[n:].any()
    np.testing.assert_allclose(np.asarray(hidden[:n]), np.asarray(tight_hidden), rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.asarray(feats[:n]), np.asarray(tight_feats), rtol=0, atol=ATOL)
    assert np.isfinite(np.asarray(hidden)).all() and np.isfinite(np.asarray(feats)).all()
    base = case["cache"]
    for name in ("k", "v"):
        got, tight, old = (np.asarray(getattr(c, name)) for c in (cache, tight_cache, base))
        np.testing.assert_allclose(got, tight, rtol=0, atol=ATOL)
        np.testing.assert_array_equal(got == old, np.asarray(tight) == old)  # same slots touched


def test_packed_attention_padding_slots_are_zeros_and_impl_is_checked():
    rng = np.random.default_rng(2)
    q, k = (rng.standard_normal((6, h, 8)).astype(np.float32) for h in (4, 2))
    cache = rng.standard_normal((3, 2, 5, 8)).astype(np.float32)
    cache_lengths = np.asarray([3, 0, 0], np.int32)

    @jax.jit
    def run(q, k, cache, cache_lengths):
        layout = pack_layout(jnp.asarray([2, 0, 1], jnp.int32), 6, 2)
        positions = cache_lengths[layout.seq_ids] + layout.offsets
        return layers.packed_attention(q, k, k, cache, cache, layout, cache_lengths, positions)

    out = np.asarray(run(q, k, cache, cache_lengths))
    assert np.isfinite(out).all() and out.shape == (6, 4, 8)
    np.testing.assert_array_equal(out[3:], 0)
    # The first token of row 2 has no cache and no earlier token: it sees only itself.
    np.testing.assert_allclose(out[2], np.repeat(np.asarray(k[2]), 2, axis=0), atol=1e-6)
    with pytest.raises(ValueError, match="unknown attention impl"):
        layers.packed_attention(q, k, k, cache, cache, pack_layout(np.asarray([2, 0, 1]), 6, 2),
                                cache_lengths, np.zeros(6, np.int32), impl="cuda")


def test_write_packed_drops_padding_slots():
    cache = jnp.zeros((2, 2, 1, 4, 1))  # [L, B, Hkv, S, Dh]
    new = jnp.arange(1, 4, dtype=jnp.float32).reshape(1, 3, 1, 1)
    new = new * jnp.asarray([1.0, 10.0])[:, None, None, None]  # [L, N, Hkv, Dh]; layer 1 = 10 x layer 0
    k, _ = write_packed(cache, cache, new, new, jnp.asarray([1, 0, 0]), jnp.asarray([2, 3, 1 << 30]))
    k = np.asarray(k)[:, :, 0, :, 0]
    np.testing.assert_array_equal(k[0], [[0, 0, 0, 2], [0, 0, 1, 0]])
    np.testing.assert_array_equal(k[1], 10 * k[0])


def test_too_few_slots_raise():
    with pytest.raises(ValueError, match="cannot hold"):
        pack_layout(np.asarray(VERIFY_LENS, np.int32), sum(VERIFY_LENS) - 1, BS)
    with pytest.raises(ValueError, match="must lie in"):
        pack_layout(np.asarray([BS + 1, 0], np.int32), 2 * BS + 2, BS)

"""KV cache: incremental decoding equals the full causal forward; rollback forgets writes.

Sequences in a batch sit at different lengths, as they do in batched and speculative
decoding, so every check is per sequence.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.decoding import autoregressive
from adaflash_jax.models.kv_cache import KVCache, write_tokens
from adaflash_jax.target_api import target_from_params
from fixtures import random_params, tiny_config

TOL = 1e-4  # fp32: same math, different shapes (logits here reach ~10)
CACHE_LEN = 32


@functools.partial(jax.jit, static_argnums=0)
def cached_forward(graphdef, state, tokens, cache):
    model = nnx.merge(graphdef, state)
    out = model(tokens, cache=cache)
    return model.logits(out.hidden), out.cache


@functools.partial(jax.jit, static_argnums=0)
def prefill(graphdef, state, tokens, lengths, cache):
    logits, _, cache = autoregressive.prefill(nnx.merge(graphdef, state), tokens, lengths, cache)
    return logits, cache


@pytest.fixture(scope="module", params=["per_layer", "stacked"])
def target(request):
    """The same weights in either layer layout (`models.decoder_layers`); every check runs on both."""
    cfg = tiny_config(num_layers=3)
    return target_from_params(cfg, random_params(cfg, seed=1), layer_layout=request.param)


@pytest.fixture(scope="module")
def sequences(target):
    rng = np.random.default_rng(0)
    return [rng.integers(3, target.cfg.vocab_size, n).tolist() for n in (14, 9)]


@pytest.fixture(scope="module")
def full_logits(target, sequences):
    """Each sequence alone through the cache-free causal forward."""
    return [target.score([s])[0] for s in sequences]


def empty_cache(target, batch):
    return autoregressive.new_cache(target.model, batch, CACHE_LEN)


def padded(rows, width=None):
    width = width or max(len(r) for r in rows)
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return jnp.asarray(out)


def run_prefill(target, sequences, prompt_lens):
    prompts = [s[:n] for s, n in zip(sequences, prompt_lens)]
    return prefill(target.graphdef, target.state, padded(prompts), jnp.asarray(prompt_lens, jnp.int32),
                   empty_cache(target, len(sequences)))


def write_chunk(target, cache, sequences, width):
    """Feeds each sequence's next `width` tokens at its own committed length (lengths kept)."""
    lengths = np.asarray(cache.lengths)
    chunk = [s[n:n + width] + [0] * (width - len(s[n:n + width])) for s, n in zip(sequences, lengths)]
    return cached_forward(target.graphdef, target.state, padded(chunk, width), cache)


def test_prefill_logits_are_last_prompt_token(target, sequences, full_logits):
    prompt_lens = [5, 2]
    logits, cache = run_prefill(target, sequences, prompt_lens)
    assert np.asarray(cache.lengths).tolist() == prompt_lens
    for b, n in enumerate(prompt_lens):
        np.testing.assert_allclose(np.asarray(logits[b]), full_logits[b][n - 1], rtol=0, atol=TOL)


def test_incremental_decode_matches_full_forward(target, sequences, full_logits):
    _, cache = run_prefill(target, sequences, [5, 2])
    checked = [0, 0]
    # One token at a time, then a 3-token chunk (a verify step), then single tokens again.
    for width in [1, 1, 1, 3, 1, 1, 3, 1, 1]:
        lengths = np.asarray(cache.lengths)
        logits, written = write_chunk(target, cache, sequences, width)
        assert np.asarray(written.lengths).tolist() == lengths.tolist()  # writing never commits
        advance = []
        for b, seq in enumerate(sequences):
            n = min(width, len(seq) - int(lengths[b]))
            for t in range(n):
                np.testing.assert_allclose(np.asarray(logits[b, t]), full_logits[b][lengths[b] + t],
                                           rtol=0, atol=TOL, err_msg=f"seq {b} pos {lengths[b] + t}")
            checked[b] += n
            advance.append(n)
        cache = written.with_lengths(lengths + np.asarray(advance))
    assert checked == [14 - 5, 9 - 2]  # every position after the prompts was compared


def test_rollback_equals_never_writing(target, sequences, full_logits):
    prompt_lens = [6, 4]
    _, base = run_prefill(target, sequences, prompt_lens)
    garbage = [[7] * 12, [9] * 12]
    # Write a rejected block, commit it, write more on top, then roll back to the prompt.
    _, dirty = write_chunk(target, base, garbage, 4)
    dirty = dirty.with_lengths(dirty.lengths + 4)
    _, dirty = write_chunk(target, dirty, garbage, 3)
    rolled = dirty.with_lengths(jnp.asarray(prompt_lens, jnp.int32))
    assert not np.array_equal(np.asarray(rolled.k[0]), np.asarray(base.k[0]))  # stale entries remain

    after_rollback, _ = write_chunk(target, rolled, sequences, 4)
    never_written, _ = write_chunk(target, base, sequences, 4)
    np.testing.assert_array_equal(np.asarray(after_rollback), np.asarray(never_written))
    for b, n in enumerate(prompt_lens):
        np.testing.assert_allclose(np.asarray(after_rollback[b]), full_logits[b][n:n + 4], rtol=0, atol=TOL)


def test_per_sequence_rollback(target, sequences, full_logits):
    """Rolling sequences back by different amounts; each continues from its own length."""
    _, cache = run_prefill(target, sequences, [8, 6])
    _, cache = write_chunk(target, cache, sequences, 3)
    cache = cache.with_lengths(jnp.asarray([11, 9], jnp.int32)).with_lengths(jnp.asarray([9, 7]))
    logits, _ = write_chunk(target, cache, sequences, 2)
    for b, n in enumerate([9, 7]):
        np.testing.assert_allclose(np.asarray(logits[b]), full_logits[b][n:n + 2], rtol=0, atol=TOL)


def test_write_tokens_drops_past_max_len_without_wrapping():
    cache = jnp.zeros((2, 2, 1, 6, 2))  # [layers, batch, kv_heads, slots, head_dim]
    new = jnp.ones((2, 2, 1, 4, 2)) * jnp.arange(1, 5, dtype=jnp.float32)[None, None, None, :, None]
    new = new * jnp.asarray([1.0, 10.0])[:, None, None, None, None]  # layer 1 = 10 x layer 0
    k, v = write_tokens(cache, cache, new, new * 2, jnp.asarray([1, 4], jnp.int32))
    k = np.asarray(k)[:, :, 0, :, 0]
    np.testing.assert_array_equal(k[0, 0], [0, 1, 2, 3, 4, 0])
    np.testing.assert_array_equal(k[0, 1], [0, 0, 0, 0, 1, 2])  # 3 and 4 fell off the end
    np.testing.assert_array_equal(k[1], 10 * k[0])
    np.testing.assert_array_equal(np.asarray(v)[:, :, 0, :, 0], 2 * k)


def test_cache_layout():
    cache = KVCache.create(3, 2, 4, 16, 8, jnp.bfloat16)
    assert cache.k.shape == (3, 2, 4, 16, 8) and cache.k.dtype == jnp.bfloat16
    assert cache.max_len == 16 and cache.lengths.dtype == jnp.int32
    assert np.asarray(cache.with_lengths([3, 5]).lengths).tolist() == [3, 5]
    per_layer = KVCache.create(3, 2, 4, 16, 8, jnp.bfloat16, per_layer=True)
    assert per_layer.per_layer and not cache.per_layer and per_layer.max_len == 16
    assert len(per_layer.k) == 3 and per_layer.k[0].shape == (2, 4, 16, 8)


@pytest.mark.parametrize("per_layer", [False, True])
def test_row_operations_agree_across_layouts(per_layer):
    """rows / put_rows / zero_rows / write act on the batch axis of every layer, in both layouts."""
    rng = np.random.default_rng(0)
    full = rng.standard_normal((3, 4, 2, 8, 5)).astype(np.float32)  # [L, B, Hkv, S, Dh]
    def make(x, lengths):
        if per_layer:
            return KVCache(k=tuple(jnp.asarray(l) for l in x), v=tuple(jnp.asarray(2 * l) for l in x),
                           lengths=jnp.asarray(lengths, jnp.int32))
        return KVCache(k=jnp.asarray(x), v=jnp.asarray(2 * x), lengths=jnp.asarray(lengths, jnp.int32))
    def stacked(c):
        return np.stack([np.asarray(l) for l in c.k]) if per_layer else np.asarray(c.k)
    cache = make(full, [1, 2, 3, 4])
    slots = jnp.asarray([2, 0])
    rows = cache.rows(slots)
    np.testing.assert_array_equal(stacked(rows), full[:, [2, 0]])
    assert np.asarray(rows.lengths).tolist() == [3, 1]
    other = make(-full[:, :2], [7, 8])
    put = stacked(cache.put_rows(slots, other))
    np.testing.assert_array_equal(put[:, [2, 0]], -full[:, :2])
    np.testing.assert_array_equal(put[:, [1, 3]], full[:, [1, 3]])
    zeroed = stacked(cache.zero_rows(jnp.asarray([False, True, False, True])))
    assert not zeroed[:, [1, 3]].any() and np.array_equal(zeroed[:, [0, 2]], full[:, [0, 2]])
    new = rng.standard_normal((3, 4, 2, 2, 5)).astype(np.float32)
    written = stacked(cache.write(jnp.asarray(new), jnp.asarray(new), jnp.asarray([0, 6, 7, 3])))
    ref_k, _ = write_tokens(jnp.asarray(full), jnp.asarray(full), jnp.asarray(new), jnp.asarray(new),
                            jnp.asarray([0, 6, 7, 3]))
    np.testing.assert_array_equal(written, np.asarray(ref_k))  # slot 7 + 1 falls off the end
    axes = cache.slot_axes()
    assert set(jax.tree.leaves(axes.k)) == {0 if per_layer else 1} and axes.lengths == 0


def test_empty_cache_prefill_equals_reading_the_empty_cache(target, sequences):
    """A prefill that attends over its own tokens only (empty_cache) writes the same K/V and
    gives the same hidden states as one that also reads the cache's empty slots."""
    prompts = padded([s[:n] for s, n in zip(sequences, (12, 7))])
    cache = empty_cache(target, len(sequences))

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def run(graphdef, state, tokens, empty):
        out = nnx.merge(graphdef, state)(tokens, cache=cache, empty_cache=empty)
        return out.hidden, out.cache

    (h_own, c_own), (h_all, c_all) = (run(target.graphdef, target.state, prompts, e) for e in (True, False))
    np.testing.assert_allclose(np.asarray(h_own), np.asarray(h_all), atol=TOL, rtol=0)
    for a, b in zip(jax.tree.leaves(c_own), jax.tree.leaves(c_all)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=0)

"""Packed layout: slots against a brute-force construction, pack/unpack round trips, buckets."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.models.packed_layout import PAD_OFFSET, pack, pack_layout, unpack

BS = 4
jit_layout = jax.jit(pack_layout, static_argnums=(1, 2))  # one dispatch instead of dozens of eager ops


@functools.partial(jax.jit, static_argnums=2)
def round_trip(values, lengths, num_slots):
    layout = pack_layout(lengths, num_slots, BS)
    packed = pack(values, layout)
    return packed, unpack(packed, layout, BS, fill=-1.0)


def brute_force_layout(lengths, num_slots):
    seq_ids, offsets, valid, row_start = [], [], [], []
    for row, n in enumerate(lengths):
        row_start.append(len(seq_ids))
        seq_ids += [row] * n
        offsets += list(range(n))
        valid += [True] * n
    pad = num_slots - len(seq_ids)
    return dict(seq_ids=seq_ids + [0] * pad, offsets=offsets + [PAD_OFFSET] * pad,
                valid=valid + [False] * pad, row_start=row_start)


CASES = [[2, 0, 4, 1], [4, 4, 4, 4], [0, 0, 0, 0], [0, 3, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("lengths", CASES)
@pytest.mark.parametrize("extra", [0, 3])
def test_layout_matches_brute_force(lengths, extra):
    num_slots = max(sum(lengths), 1) + extra
    layout = jit_layout(np.asarray(lengths, np.int32), num_slots, BS)
    want = brute_force_layout(lengths, num_slots)
    for field, values in want.items():
        np.testing.assert_array_equal(np.asarray(getattr(layout, field)), values, err_msg=field)
    assert layout.num_slots == num_slots and layout.batch == len(lengths) and layout.block_size == BS


def test_eager_layout_matches_jitted():
    lengths = np.asarray([2, 0, 4, 1], np.int32)
    eager, jitted = pack_layout(lengths, 9, BS), jit_layout(lengths, 9, BS)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("lengths", CASES)
def test_pack_unpack_round_trip(lengths):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((len(lengths), BS, 3)).astype(np.float32)
    packed, back = map(np.asarray, round_trip(values, np.asarray(lengths, np.int32), sum(lengths) + 2))
    want = [values[b, t] for b, n in enumerate(lengths) for t in range(n)]
    np.testing.assert_array_equal(packed[:sum(lengths)], np.asarray(want).reshape(-1, 3))
    np.testing.assert_array_equal(packed[sum(lengths):], 0)  # padding slots are zeros
    keep = np.arange(BS)[None] < np.asarray(lengths)[:, None]
    np.testing.assert_array_equal(back[keep], values[keep])
    np.testing.assert_array_equal(back[~keep], -1.0)


def test_unpack_integer_values_and_default_width():
    @jax.jit
    def run(values):
        return unpack(values, pack_layout(jnp.asarray([1, 3], jnp.int32), 4, 3))

    out = run(jnp.arange(10, 14, dtype=jnp.int32))
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), [[10, 0, 0], [11, 12, 13]])


def test_bad_lengths_raise():
    with pytest.raises(ValueError, match="cannot hold"):
        pack_layout(np.asarray([3, 3]), 5, BS)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        pack_layout(np.asarray([5, 0]), 8, BS)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        pack_layout(np.asarray([-1, 2]), 8, BS)


def test_default_buckets():
    assert default_buckets(8, 16) == (8, 16, 32, 64, 128)
    assert default_buckets(3, 5) == (3, 6, 12, 15)
    assert default_buckets(4, 1) == (4,)
    for batch, bs in [(1, 16), (32, 16), (5, 7)]:
        buckets = default_buckets(batch, bs)
        assert list(buckets) == sorted(set(buckets)) and buckets[-1] == batch * bs
        assert buckets[0] == batch and all(b2 <= 2 * b1 for b1, b2 in zip(buckets, buckets[1:]))
    with pytest.raises(ValueError):
        default_buckets(0, 4)

"""Property tests of the packed verify layout, on lengths hypothesis draws.

For any batch, block size and verified lengths, the bucket the engine picks holds
every verified token, each row's tokens land in distinct slots in their order,
padding is marked invalid past every cache, and pack/unpack give the rows back.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash_jax.decoding.packed_verify import verify_shapes
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.models.packed_layout import PAD_OFFSET, pack, pack_layout, unpack
from adaflash_jax.decoding.verify_plan import bucket_index


@st.composite
def verify_steps(draw):
    """(block size, lengths): each row verifies 0..Bs of its block's tokens."""
    bs = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, bs), min_size=1, max_size=6))
    return bs, np.asarray(lengths, np.int32)


@settings(max_examples=60, deadline=None, database=None)
@given(verify_steps())
def test_bucket_holds_every_row_in_order(step):
    bs, lengths = step
    batch, total = lengths.size, int(lengths.sum())
    buckets = default_buckets(batch, bs)
    k = int(bucket_index(total, buckets))
    num_slots, width = verify_shapes(batch, bs, buckets)[k + 1]
    assert num_slots >= total and width == bs
    assert k == 0 or buckets[k - 1] < total  # the smallest bucket that fits

    layout = pack_layout(lengths, num_slots, bs)
    seq_ids, offsets, valid = (np.asarray(x) for x in (layout.seq_ids, layout.offsets, layout.valid))
    assert int(valid.sum()) == total and not valid[total:].any()
    assert (offsets[~valid] == PAD_OFFSET).all() and (seq_ids[~valid] == 0).all()
    slots_seen = set()
    for row, n in enumerate(lengths):
        slots = np.flatnonzero(valid & (seq_ids == row))
        assert len(slots) == n
        assert list(offsets[slots]) == list(range(n))  # in order: offset t before t + 1
        assert (np.diff(slots) == 1).all()  # contiguous, so the row's span is one slice
        if n:
            assert slots[0] == int(layout.row_start[row])
        slots_seen.update(slots.tolist())
    assert len(slots_seen) == total  # no two tokens share a slot

    values = np.arange(batch * bs, dtype=np.int32).reshape(batch, bs) + 1
    packed = np.asarray(pack(values, layout))
    keep = np.arange(bs)[None] < lengths[:, None]
    assert packed[:total].tolist() == values[keep].tolist() and (packed[total:] == 0).all()
    back = np.asarray(unpack(packed, layout, bs, fill=-1))
    assert (back[keep] == values[keep]).all() and (back[~keep] == -1).all()


@settings(max_examples=40, deadline=None, database=None)
@given(st.integers(1, 40), st.integers(1, 32))
def test_buckets_cover_an_ar_step_and_a_full_block(batch, bs):
    buckets = default_buckets(batch, bs)
    assert buckets[0] == batch and buckets[-1] == batch * bs
    assert all(b1 < b2 <= 2 * b1 for b1, b2 in zip(buckets, buckets[1:]))
    assert all(b % batch == 0 for b in buckets)

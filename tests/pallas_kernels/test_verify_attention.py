"""Packed verification attention: both Pallas variants (interpret mode) against the reference.

Each kernel shape is compiled once and then run on several layouts (ragged with
empty rows, a bucket filled exactly, all padding, slots in shuffled order) and
cache lengths (0, full, in between); the layouts are runtime data, so the grid
stays cheap on a CPU. The shapes cover the engine's AR step (width 1, N = B)
and drafted buckets (width 8/16, N = B·2^k up to B·Bs), GQA group sizes 1/2/4,
head dims 64/128, float32 and bfloat16.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import CUSTOM_CALLS, ON_CPU, compiled, export_for

from pallas_kernels.common import choose_kernel
from pallas_kernels.verify_attention import (
    BlockSizes,
    verify_attention,
    verify_attention_reference,
)

B = 4
PAD_OFFSET = 1 << 30  # what the packed layout puts in padding slots
TOL = {"float32": {"atol": 1e-5, "rtol": 1e-5}, "bfloat16": {"atol": 2e-2, "rtol": 2e-2}}


def layout(lengths, num_slots, rng=None):
    """Rows back to back, padding at the end; with `rng`, the slots in a random order."""
    seq, off = [], []
    for row, n in enumerate(lengths):
        seq += [row] * n
        off += list(range(n))
    pad = num_slots - len(seq)
    assert pad >= 0
    seq_ids = np.array(seq + [0] * pad, np.int32)
    offsets = np.array(off + [PAD_OFFSET] * pad, np.int32)
    valid = np.array([True] * len(seq) + [False] * pad)
    if rng is not None:
        perm = rng.permutation(num_slots)
        seq_ids, offsets, valid = seq_ids[perm], offsets[perm], valid[perm]
    return seq_ids, offsets, valid


def ragged_lengths(rng, width, num_slots):
    lengths = rng.integers(0, width + 1, B)
    lengths[1] = 0  # an empty row
    while lengths.sum() > num_slots:
        lengths[np.argmax(lengths)] -= 1
    return lengths


def filled_lengths(rng, width, num_slots):
    """Random lengths summing to min(N, B·width): a bucket without padding."""
    lengths = np.zeros(B, np.int64)
    for _ in range(min(num_slots, B * width)):
        lengths[rng.choice(np.flatnonzero(lengths < width))] += 1
    return lengths


def cases(rng, width, num_slots, cache_len):
    """(seq_ids, offsets, valid, cache_lengths) layouts for one shape."""
    ragged = ragged_lengths(rng, width, num_slots)
    edge_cache = np.array([0, cache_len // 3, cache_len - 1, cache_len])  # empty, partial, full caches
    rand_cache = rng.integers(0, cache_len + 1, B)
    return [
        (*layout(ragged, num_slots), edge_cache),
        (*layout(filled_lengths(rng, width, num_slots), num_slots), rand_cache),
        (*layout(np.zeros(B, np.int64), num_slots), rand_cache),  # every slot is padding
        (*layout(ragged, num_slots, rng), edge_cache[::-1].copy()),  # slots in any order
    ]


def inputs(rng, dtype, num_slots, heads, kv_heads, head_dim, cache_len):
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return (normal(num_slots, heads, head_dim), normal(num_slots, kv_heads, head_dim),
            normal(num_slots, kv_heads, head_dim), normal(B, kv_heads, cache_len, head_dim),
            normal(B, kv_heads, cache_len, head_dim))


def with_layout(arrays, case):
    return tuple(arrays) + tuple(jnp.asarray(x) for x in case)


# name: (dtype, head_dim, heads, kv_heads, width, slots, cache S, block_kv); every shape runs both variants
SHAPES = {
    "ar-f32-g1": ("float32", 64, 4, 4, 1, B, 64, 16),  # the AR step: width 1, N = B
    "w8-f32-g2-n4b": ("float32", 128, 4, 2, 8, 4 * B, 48, 16),
    "w16-f32-g2-n2b": ("float32", 64, 4, 2, 16, 2 * B, 48, 16),  # a bucket far smaller than B·Bs
    "w16-bf16-g4-n16b": ("bfloat16", 128, 8, 2, 16, 16 * B, 64, 32),  # the largest bucket, B·Bs
    "w8-bf16-g1-n8b": ("bfloat16", 64, 2, 2, 8, 8 * B, 48, 16),
    "ar-bf16-g4": ("bfloat16", 64, 4, 1, 1, B, 32, 16),
}


def kernel_options(variant, width, block_kv):
    """verify_attention's keywords; on a CPU host the TPU run goes through the `impl="pallas"` default."""
    if variant == "tpu" and ON_CPU:
        assert choose_kernel("pallas") == choose_kernel("pallas", "tpu", True)
        return {"impl": "pallas", "block_sizes": BlockSizes(block_kv), "width": width}
    sizes = BlockSizes(block_kv) if variant == "tpu" else BlockSizes(block_kv, num_warps=4, num_stages=2)
    return {"impl": "pallas", "variant": variant, "interpret": True, "block_sizes": sizes, "width": width}


def example(shape):
    dtype, head_dim, heads, kv_heads, width, slots, cache_len, _ = SHAPES[shape]
    rng = np.random.default_rng(0)
    arrays = inputs(rng, getattr(jnp, dtype), slots, heads, kv_heads, head_dim, cache_len)
    return with_layout(arrays, cases(rng, width, slots, cache_len)[0])


@functools.cache
def kernel_for(shape, variant):
    width, block_kv = SHAPES[shape][4], SHAPES[shape][7]
    return compiled(functools.partial(verify_attention, **kernel_options(variant, width, block_kv)),
                    *example(shape))


@functools.cache
def reference_for(shape):
    return compiled(verify_attention_reference, *example(shape))


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_reference(shape, variant):
    dtype, head_dim, heads, kv_heads, width, slots, cache_len, _ = SHAPES[shape]
    kernel, reference = kernel_for(shape, variant), reference_for(shape)
    rng = np.random.default_rng(1)
    arrays = inputs(rng, getattr(jnp, dtype), slots, heads, kv_heads, head_dim, cache_len)
    for case in cases(rng, width, slots, cache_len):
        args = with_layout(arrays, case)
        out, ref = kernel(*args), reference(*args)
        assert out.shape == (slots, heads, head_dim) and out.dtype == arrays[0].dtype
        out, ref, valid = np.asarray(out, np.float32), np.asarray(ref, np.float32), np.asarray(case[2])
        np.testing.assert_allclose(out, ref, err_msg=f"{shape}/{variant}, layout {case}", **TOL[dtype])
        assert not np.any(out[~valid]), "padding slots must be zeros"


def test_reference_matches_brute_force():
    """The reference against a per-slot loop over the definition (float64 numpy)."""
    rng = np.random.default_rng(2)
    heads, kv_heads, head_dim, cache_len, slots = 4, 2, 8, 6, 8
    q, kn, vn, ck, cv = (np.asarray(x, np.float64) for x in
                         inputs(rng, jnp.float32, slots, heads, kv_heads, head_dim, cache_len))
    seq_ids, offsets, valid = layout([2, 0, 3, 1], slots, rng)
    cache_lengths = np.array([3, 6, 0, 1], np.int32)
    args = (*(jnp.asarray(x, jnp.float32) for x in (q, kn, vn, ck, cv)), jnp.asarray(seq_ids),
            jnp.asarray(offsets), jnp.asarray(valid), jnp.asarray(cache_lengths))
    out = np.asarray(compiled(verify_attention_reference, *args)(*args))
    group = heads // kv_heads
    for j in range(slots):
        if not valid[j]:
            assert not out[j].any()
            continue
        row = seq_ids[j]
        mine = [i for i in range(slots) if valid[i] and seq_ids[i] == row and offsets[i] <= offsets[j]]
        for hd in range(heads):
            kv = hd // group
            keys = np.concatenate([ck[row, kv, :cache_lengths[row]], kn[mine, kv]])
            values = np.concatenate([cv[row, kv, :cache_lengths[row]], vn[mine, kv]])
            scores = keys @ q[j, hd] / np.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            np.testing.assert_allclose(out[j, hd], weights @ values / weights.sum(), atol=1e-5, rtol=1e-5)


def test_matches_model_xla_path():
    """The TPU kernel against `models.layers.packed_attention` on `pack_layout` layouts."""
    from adaflash_jax.models.packed_layout import pack_layout
    from adaflash_jax.models.layers import packed_attention

    shape = "w8-f32-g2-n4b"
    dtype, head_dim, heads, kv_heads, width, slots, cache_len, _ = SHAPES[shape]
    kernel = kernel_for(shape, "tpu")

    def model_path(q, k_new, v_new, cache_k, cache_v, lengths, cache_lengths):
        lay = pack_layout(lengths, slots, width)
        positions = cache_lengths[lay.seq_ids] + lay.offsets
        out = packed_attention(q, k_new, v_new, cache_k, cache_v, lay, cache_lengths, positions)
        return out, lay.seq_ids, lay.offsets, lay.valid

    rng = np.random.default_rng(3)
    arrays = inputs(rng, getattr(jnp, dtype), slots, heads, kv_heads, head_dim, cache_len)
    model_path = compiled(model_path, *arrays, jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32))
    for lengths, cache_lengths in (([3, 0, 8, 5], [7, 0, 48, 20]), ([1, 1, 1, 1], [0, 5, 33, 47])):
        cache_lengths = jnp.asarray(cache_lengths, jnp.int32)
        want, seq_ids, offsets, valid = model_path(*arrays, jnp.asarray(lengths, jnp.int32), cache_lengths)
        got = kernel(*arrays, seq_ids, offsets, valid, cache_lengths)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL[dtype])


def test_xla_and_auto_are_the_reference():
    """impl="xla" traces to exactly the reference; so does impl="auto" on a CPU host."""
    args = example("ar-f32-g1")
    want = str(jax.make_jaxpr(verify_attention_reference)(*args))
    assert str(jax.make_jaxpr(functools.partial(verify_attention, impl="xla", width=1))(*args)) == want
    if ON_CPU:
        assert str(jax.make_jaxpr(functools.partial(verify_attention, impl="auto"))(*args)) == want
    else:
        assert str(jax.make_jaxpr(functools.partial(verify_attention, impl="auto"))(*args)) != want


# ------------------------------------------------------------------ lowering for the real chips


def export_args(dtype, width, slots, heads=8, kv_heads=2, head_dim=128, cache_len=1024):
    sds = jax.ShapeDtypeStruct
    return (sds((slots, heads, head_dim), dtype), sds((slots, kv_heads, head_dim), dtype),
            sds((slots, kv_heads, head_dim), dtype), sds((B, kv_heads, cache_len, head_dim), dtype),
            sds((B, kv_heads, cache_len, head_dim), dtype), sds((slots,), jnp.int32),
            sds((slots,), jnp.int32), sds((slots,), jnp.bool_), sds((B,), jnp.int32))


EXPORT_SHAPES = {"ar-f32": (jnp.float32, 1, B), "drafted-bf16": (jnp.bfloat16, 16, 16 * B)}


@pytest.mark.parametrize("variant, cache_len", [("tpu", 1024), ("gpu", 1536)])
@pytest.mark.parametrize("shape", list(EXPORT_SHAPES))
def test_variant_lowers(shape, variant, cache_len):
    dtype, width, slots = EXPORT_SHAPES[shape]
    fn = functools.partial(verify_attention, impl="pallas", variant=variant, interpret=False, width=width)
    # Triton kernels carry no serialization-stability guarantee: export_for allows their custom call.
    exported = export_for(fn, variant, *export_args(dtype, width, slots, cache_len=cache_len))
    assert CUSTOM_CALLS[variant] in exported.mlir_module()


# ------------------------------------------------------------------ bad inputs


def good_args(slots=2 * B, heads=4, kv_heads=2, head_dim=16, cache_len=32):
    rng = np.random.default_rng(5)
    arrays = inputs(rng, jnp.float32, slots, heads, kv_heads, head_dim, cache_len)
    return list(with_layout(arrays, (*layout([2, 0, 1, 3], slots), np.array([1, 2, 3, 4], np.int32))))


BAD = {
    "q not 3-D": (0, lambda a: a[:, 0]),
    "k_new slots": (1, lambda a: a[:-1]),
    "v_new heads": (2, lambda a: jnp.concatenate([a, a], axis=1)),
    "cache_k head dim": (3, lambda a: a[..., :-1]),
    "cache_v length": (4, lambda a: a[:, :, :-1]),
    "seq_ids shape": (5, lambda a: a[:-1]),
    "seq_ids float": (5, lambda a: a.astype(jnp.float32)),
    "offsets shape": (6, lambda a: a[None]),
    "valid shape": (7, lambda a: a[:-1]),
    "cache_lengths shape": (8, lambda a: a[:-1]),
}


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_shapes_raise(case, impl):
    index, mutate = BAD[case]
    args = good_args()
    args[index] = mutate(args[index])
    with pytest.raises(ValueError):
        verify_attention(*args, impl=impl, variant="tpu" if impl == "pallas" else None, interpret=True)


def test_heads_not_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="multiple of kv heads"):
        verify_attention(*good_args(heads=3, kv_heads=2), impl="xla")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        verify_attention_reference(*good_args(heads=6, kv_heads=4))


def test_bad_options_raise():
    args = good_args()
    with pytest.raises(ValueError, match="impl"):
        verify_attention(*args, impl="triton")
    with pytest.raises(ValueError, match="variant"):
        verify_attention(*args, impl="pallas", variant="cpu")
    with pytest.raises(ValueError, match="width"):
        verify_attention(*args, impl="pallas", variant="tpu", interpret=True, width=0)
    with pytest.raises(ValueError, match="offsets"):  # row 3 verifies 3 tokens: width 2 is too small
        verify_attention(*args, impl="pallas", variant="tpu", interpret=True, width=2)
    dup = list(args)
    dup[6] = dup[6].at[1].set(0)  # row 0's second token claims offset 0 as well
    with pytest.raises(ValueError, match="at most one"):
        verify_attention(*dup, impl="pallas", variant="tpu", interpret=True, width=4)
    with pytest.raises(ValueError, match="power-of-two divisor"):
        verify_attention(*good_args(cache_len=40), impl="pallas", variant="gpu", interpret=True, width=4)
    with pytest.raises(ValueError, match="head dim"):
        verify_attention(*good_args(head_dim=24), impl="pallas", variant="gpu", interpret=True, width=4)
    with pytest.raises(ValueError, match="num_warps"):
        verify_attention(*args, impl="pallas", variant="tpu", interpret=True, width=4,
                         block_sizes=BlockSizes.for_variant("gpu"))
    with pytest.raises(TypeError, match="BlockSizes"):
        verify_attention(*args, impl="pallas", variant="tpu", interpret=True, width=4, block_sizes=512)


@pytest.mark.parametrize("kwargs, variant, match", [
    ({"block_kv": 0}, None, "block_kv"),
    ({"block_kv": 16.0}, None, "block_kv"),
    ({"block_kv": 16, "num_warps": 3}, None, "num_warps"),
    ({"block_kv": 16, "num_stages": 0}, None, "num_stages"),
    ({"block_kv": 12}, "tpu", "multiple of 8"),
    ({"block_kv": 24}, "gpu", "power of two"),
    ({"block_kv": 8}, "gpu", "power of two"),
])
def test_block_sizes_validation(kwargs, variant, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs).validate(variant or "tpu")


def test_block_size_defaults():
    assert BlockSizes.for_variant("tpu") == BlockSizes(512).validate("tpu")
    assert BlockSizes.for_variant("gpu") == BlockSizes(64, num_warps=4, num_stages=2).validate("gpu")
    with pytest.raises(ValueError, match="variant"):
        BlockSizes.for_variant("cpu")

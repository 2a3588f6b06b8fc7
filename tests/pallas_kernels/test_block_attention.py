"""Block-diffusion drafter attention kernels (inference and training) against their jnp references.

The kernels run in interpret mode on CPU (both the TPU and the GPU variant);
the lowering tests export them for TPU and CUDA from this host. Context slots
that a kernel must skip are filled with NaN: a kernel that reads a skipped
tile into its softmax would return NaN.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import CUSTOM_CALLS, export_for, fast_jit

from pallas_kernels._block_attention_train_layout import block_map, visit_lists
from pallas_kernels.block_attention import (
    BlockSizes,
    block_attention,
    block_attention_reference,
)
from pallas_kernels.block_attention_train import (
    block_attention_train,
    block_attention_train_reference,
    train_mask,
)

ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
TILES = BlockSizes(block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=16)


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def _poison(x, live, tile=16):
    """NaN in every context slot at or past round_up(live[b], tile), per row b.

    `tile` is the forward kv tile (or a multiple of every kv tile the call uses):
    those slots lie in tiles that no kernel may read.
    """
    first_dead = -(-live // tile) * tile
    dead = jnp.arange(x.shape[2])[None, :] >= first_dead[:, None]
    return jnp.where(dead[:, None, :, None], jnp.nan, x)


def _close(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=ATOL[dtype], rtol=0)


# --------------------------------------------------------------------------- inference


def _inference_inputs(*, group, bs, dh, dtype, s, hkv=2, seed=0):
    rng = np.random.default_rng(seed)
    b, h = 4, group * hkv
    q = _normal(rng, (b, h, bs, dh), dtype)
    ctx_k, ctx_v = (_normal(rng, (b, hkv, s, dh), dtype) for _ in range(2))
    blk_k, blk_v = (_normal(rng, (b, hkv, bs, dh), dtype) for _ in range(2))
    lengths = jnp.array([0, 16, 23, s], jnp.int32)  # empty, on a tile edge, ragged, full
    return q, ctx_k, ctx_v, lengths, blk_k, blk_v


INFERENCE_CASES = [  # variant, group (H / Hkv), block size, head dim, dtype, context slots S
    ("tpu", 1, 8, 64, jnp.float32, 48),
    ("tpu", 2, 16, 128, jnp.bfloat16, 40),
    ("tpu", 4, 8, 128, jnp.float32, 37),
    ("tpu", 4, 16, 64, jnp.bfloat16, 48),
    ("tpu", 2, 10, 64, jnp.float32, 48),
    ("gpu", 1, 16, 128, jnp.float32, 40),
    ("gpu", 2, 8, 64, jnp.bfloat16, 48),
    ("gpu", 4, 16, 64, jnp.float32, 48),
    ("gpu", 4, 8, 128, jnp.bfloat16, 37),
    ("gpu", 2, 10, 64, jnp.float32, 48),
]


@pytest.mark.parametrize("variant,group,bs,dh,dtype,s", INFERENCE_CASES)
def test_inference_kernel_matches_reference(variant, group, bs, dh, dtype, s):
    args = _inference_inputs(group=group, bs=bs, dh=dh, dtype=dtype, s=s)
    ref = fast_jit(block_attention_reference)(*args)

    def kernel(q, ctx_k, ctx_v, lengths, blk_k, blk_v):
        return block_attention(q, _poison(ctx_k, lengths), _poison(ctx_v, lengths), lengths, blk_k, blk_v,
                               impl="pallas", variant=variant, interpret=True, block_sizes=TILES)

    out = fast_jit(kernel)(*args)
    q = args[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    _close(out, ref, dtype)


def test_inference_default_block_sizes_single_tile():
    args = _inference_inputs(group=2, bs=16, dh=64, dtype=jnp.float32, s=40)
    args = (*args[:3], jnp.array([-3, 16, 23, 45], jnp.int32), *args[4:])  # lengths outside [0, S] clip
    out = fast_jit(lambda *a: block_attention(*a, impl="pallas"))(*args)  # TPU variant, interpreted, on CPU
    _close(out, fast_jit(block_attention_reference)(*args), jnp.float32)


def test_inference_reference_matches_model_attention():
    from adaflash_jax.models.layers import attention

    q, ctx_k, ctx_v, lengths, blk_k, blk_v = _inference_inputs(group=2, bs=8, dh=64, dtype=jnp.float32, s=24)
    b, bs, s = q.shape[0], q.shape[2], ctx_k.shape[2]
    ctx = jnp.arange(s)[None, None] < lengths[:, None, None]
    mask = jnp.concatenate([jnp.broadcast_to(ctx, (b, bs, s)), jnp.ones((b, bs, bs), bool)], -1)
    want = fast_jit(attention)(q, (ctx_k, blk_k), (ctx_v, blk_v), mask)
    got = fast_jit(block_attention_reference)(q, ctx_k, ctx_v, lengths, blk_k, blk_v)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_inference_xla_and_auto_are_the_reference():
    args = _inference_inputs(group=2, bs=8, dh=64, dtype=jnp.float32, s=24)
    ref = jax.make_jaxpr(block_attention_reference)(*args)
    for kwargs in ({"impl": "xla"}, {"impl": "auto"}, {}):  # a CPU host: "auto" is the reference
        got = jax.make_jaxpr(lambda *a, kw=kwargs: block_attention(*a, **kw))(*args)
        assert str(got) == str(ref)


def test_inference_rejects_bad_inputs():
    q, ctx_k, ctx_v, lengths, blk_k, blk_v = _inference_inputs(group=2, bs=8, dh=64, dtype=jnp.float32, s=24)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        block_attention(q[:, :3], ctx_k, ctx_v, lengths, blk_k, blk_v, impl="pallas")
    with pytest.raises(ValueError, match="ctx_lengths"):
        block_attention(q, ctx_k, ctx_v, lengths[:2], blk_k, blk_v, impl="pallas")
    with pytest.raises(ValueError, match="ctx_lengths"):
        block_attention(q, ctx_k, ctx_v, lengths.astype(jnp.float32), blk_k, blk_v)
    with pytest.raises(ValueError, match="blk_k"):
        block_attention(q, ctx_k, ctx_v, lengths, blk_k[:, :, :4], blk_v, impl="pallas")
    with pytest.raises(ValueError, match="ctx_k"):
        block_attention(q, ctx_k[..., :32], ctx_v[..., :32], lengths, blk_k, blk_v)
    with pytest.raises(ValueError, match="q must be"):
        block_attention(q[0], ctx_k, ctx_v, lengths, blk_k, blk_v)
    with pytest.raises(ValueError, match="unknown kernel impl"):
        block_attention(q, ctx_k, ctx_v, lengths, blk_k, blk_v, impl="cuda")
    with pytest.raises(ValueError, match="unknown kernel variant"):
        block_attention(q, ctx_k, ctx_v, lengths, blk_k, blk_v, impl="pallas", variant="mps")
    with pytest.raises(TypeError, match="BlockSizes"):
        block_attention(q, ctx_k, ctx_v, lengths, blk_k, blk_v, impl="pallas", block_sizes=(16, 16))


# --------------------------------------------------------------------------- block sizes


def test_block_sizes_defaults_and_validation():
    tpu, gpu = BlockSizes.for_variant("tpu"), BlockSizes.for_variant("gpu")
    assert (tpu.block_q, tpu.block_kv, tpu.q_bwd, tpu.kv_bwd) == (128, 512, 128, 256)
    assert (gpu.block_q, gpu.block_kv, gpu.q_bwd, gpu.kv_bwd) == (64, 64, 32, 32)
    assert (gpu.warps(64), gpu.warps(128), BlockSizes(num_warps=2).warps(128)) == (4, 8, 2)
    assert BlockSizes(block_q=32, block_kv=64).kv_bwd == 64  # backward tiles default to the forward ones
    assert tpu.check("tpu") is tpu and gpu.check("gpu") is gpu
    with pytest.raises(ValueError, match="positive int"):
        BlockSizes(block_q=0)
    with pytest.raises(ValueError, match="positive int"):
        BlockSizes(block_kv=16.0)
    with pytest.raises(ValueError, match="multiples of 8"):
        BlockSizes(block_q=12).check("tpu")
    with pytest.raises(ValueError, match="powers of two >= 16"):
        BlockSizes(block_q=48, block_kv=64).check("gpu")
    with pytest.raises(ValueError, match="powers of two >= 16"):
        BlockSizes(block_q=8, block_kv=64).check("gpu")
    with pytest.raises(ValueError, match="unknown kernel variant"):
        BlockSizes.for_variant("cpu")


# --------------------------------------------------------------------------- training


def _train_inputs(*, h, hkv, n, bs, t, dh, dtype=jnp.float32, seed=1):
    rng = np.random.default_rng(seed)
    b, r = 2, n * bs
    q = _normal(rng, (b, h, r, dh), dtype)
    ctx_k, ctx_v = (_normal(rng, (b, hkv, t, dh), dtype) for _ in range(2))
    blk_k, blk_v = (_normal(rng, (b, hkv, r, dh), dtype) for _ in range(2))
    anchors = np.sort(rng.integers(1, t, (b, n)), axis=1)
    anchors[0, -1], anchors[1, 0] = 0, t  # an invalid block (anchor 0) and a full-context one
    return (q, ctx_k, ctx_v, blk_k, blk_v), jnp.asarray(anchors, jnp.int32)


def _value_and_vjp(fn, arrays):
    """fn(*arrays) and the gradients of sum(fn(*arrays) * fixed weights) w.r.t. every array."""
    def run(*args):
        out, pullback = jax.vjp(fn, *args)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return out, pullback(weights.astype(out.dtype))
    return fast_jit(run)(*arrays)


SPLIT_TILES = BlockSizes(block_q=32, block_kv=32, block_q_bwd=16, block_kv_bwd=16)  # backward tiles smaller
TRAIN_CASES = [  # variant, H, Hkv, blocks N, block size, context T, head dim, tiles
    ("tpu", 4, 2, 4, 8, 40, 64, TILES),
    ("gpu", 4, 2, 4, 8, 40, 64, TILES),
    ("tpu", 4, 1, 3, 10, 37, 64, TILES),
    ("gpu", 4, 1, 3, 10, 37, 64, TILES),
    ("tpu", 2, 2, 5, 8, 64, 128, SPLIT_TILES),
    ("gpu", 8, 4, 5, 8, 40, 64, SPLIT_TILES),
]


@pytest.mark.parametrize("variant,h,hkv,n,bs,t,dh,tiles", TRAIN_CASES)
def test_train_kernel_forward_and_grads_match_reference(variant, h, hkv, n, bs, t, dh, tiles):
    arrays, anchors = _train_inputs(h=h, hkv=hkv, n=n, bs=bs, t=t, dh=dh)
    live = jnp.max(anchors, axis=1)

    def reference(q, ctx_k, ctx_v, blk_k, blk_v):
        return block_attention_train_reference(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size=bs)

    def kernel(q, ctx_k, ctx_v, blk_k, blk_v):
        poison = functools.partial(_poison, live=live, tile=tiles.block_kv)
        return block_attention_train(q, poison(ctx_k), poison(ctx_v), blk_k, blk_v, anchors,
                                     block_size=bs, impl="pallas", variant=variant, interpret=True,
                                     block_sizes=tiles)

    ref, ref_grads = _value_and_vjp(reference, arrays)
    out, grads = _value_and_vjp(kernel, arrays)
    _close(out, ref, jnp.float32)
    for name, got, want in zip(("q", "ctx_k", "ctx_v", "blk_k", "blk_v"), grads, ref_grads, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert np.isfinite(np.asarray(got)).all(), name
        np.testing.assert_allclose(got, want, atol=ATOL[jnp.float32], rtol=0, err_msg=name)


def test_train_kernel_bf16_forward():
    arrays, anchors = _train_inputs(h=4, hkv=2, n=4, bs=8, t=48, dh=64, dtype=jnp.bfloat16)
    ref = fast_jit(lambda *a: block_attention_train_reference(*a, anchors, block_size=8))(*arrays)
    out = fast_jit(lambda *a: block_attention_train(*a, anchors, block_size=8, impl="pallas", variant="tpu",
                                                interpret=True, block_sizes=TILES))(*arrays)
    assert out.dtype == jnp.bfloat16
    _close(out, ref, jnp.bfloat16)


def test_block_map_and_visit_lists():
    # two query tiles of two blocks each, context tiles of 16 keys
    anchors = jnp.array([[0, 5, 17, 40], [40, 0, 16, 16]], jnp.int32)
    counts, full = block_map(anchors, 2, 16)
    np.testing.assert_array_equal(counts, [[1, 3], [3, 1]])  # tiles up to the tile's largest anchor
    np.testing.assert_array_equal(full, [[0, 1], [0, 1]])  # unmasked tiles: below its smallest anchor
    qlist, qcount = visit_lists(counts, 3)
    np.testing.assert_array_equal(qcount, [[2, 1, 1], [2, 1, 1]])
    # per context tile, the query tiles that see it, then the last one repeated (no refetch)
    np.testing.assert_array_equal(qlist, [[[0, 1], [1, 1], [1, 1]], [[0, 1], [0, 0], [0, 0]]])


def test_train_reference_mask_is_the_training_mask():
    from adaflash_jax.training.anchors import block_attention_mask

    anchors = jnp.array([[0, 3, 7], [5, 5, 9]], jnp.int32)
    np.testing.assert_array_equal(train_mask(anchors, seq_len=9, block_size=4),
                                  block_attention_mask(anchors, seq_len=9, block_size=4))


def test_train_xla_and_auto_are_the_reference():
    arrays, anchors = _train_inputs(h=4, hkv=2, n=2, bs=8, t=24, dh=64)
    ref = jax.make_jaxpr(lambda *a: block_attention_train_reference(*a, anchors, block_size=8))(*arrays)
    for kwargs in ({"impl": "xla"}, {"impl": "auto"}, {}):  # a CPU host: "auto" is the reference
        got = jax.make_jaxpr(lambda *a, kw=kwargs: block_attention_train(*a, anchors, block_size=8, **kw))(*arrays)
        assert str(got) == str(ref)


def test_train_rejects_bad_inputs():
    (q, ctx_k, ctx_v, blk_k, blk_v), anchors = _train_inputs(h=4, hkv=2, n=2, bs=8, t=24, dh=64)
    with pytest.raises(ValueError, match="N\\*block_size"):
        block_attention_train(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size=4, impl="pallas")
    with pytest.raises(ValueError, match="block_size"):
        block_attention_train(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size=0)
    with pytest.raises(ValueError, match="anchors"):
        block_attention_train(q, ctx_k, ctx_v, blk_k, blk_v, anchors.astype(jnp.float32), block_size=8)
    with pytest.raises(ValueError, match="anchors"):
        block_attention_train(q, ctx_k, ctx_v, blk_k, blk_v, anchors[:1], block_size=8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        block_attention_train(q[:, :3], ctx_k, ctx_v, blk_k, blk_v, anchors, block_size=8)
    with pytest.raises(ValueError, match="blk_k"):
        block_attention_train(q, ctx_k, ctx_v, blk_k[:, :1], blk_v[:, :1], anchors, block_size=8)
    with pytest.raises(ValueError, match="ctx_k"):
        block_attention_train(q, ctx_k, ctx_v[:, :, :8], blk_k, blk_v, anchors, block_size=8)
    with pytest.raises(ValueError, match="powers of two"):
        block_attention_train(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size=8, impl="pallas",
                              variant="gpu", block_sizes=BlockSizes(block_q=24))


# --------------------------------------------------------------------------- lowering for TPU and CUDA


def _export(fn, variant, *shapes):
    """How many kernel calls fn lowers to for the variant's accelerator."""
    return export_for(fn, variant, *shapes).mlir_module().count(CUSTOM_CALLS[variant])


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
def test_inference_kernel_lowers(variant):
    b, h, hkv, bs, s, dh = 2, 8, 2, 16, 1024, 128
    sds = jax.ShapeDtypeStruct
    shapes = [sds((b, h, bs, dh), jnp.bfloat16), sds((b, hkv, s, dh), jnp.bfloat16),
              sds((b, hkv, s, dh), jnp.bfloat16), sds((b,), jnp.int32), sds((b, hkv, bs, dh), jnp.bfloat16),
              sds((b, hkv, bs, dh), jnp.bfloat16)]

    def fn(*args):
        return block_attention(*args, impl="pallas", variant=variant, interpret=False)

    assert _export(fn, variant, *shapes) == 1


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
def test_train_kernel_forward_and_backward_lower(variant):
    b, h, hkv, n, bs, t, dh = 2, 8, 2, 8, 16, 512, 128
    sds = jax.ShapeDtypeStruct
    shapes = [sds((b, h, n * bs, dh), jnp.bfloat16), sds((b, hkv, t, dh), jnp.bfloat16),
              sds((b, hkv, t, dh), jnp.bfloat16), sds((b, hkv, n * bs, dh), jnp.bfloat16),
              sds((b, hkv, n * bs, dh), jnp.bfloat16), sds((b, n), jnp.int32)]

    def loss(q, ctx_k, ctx_v, blk_k, blk_v, anchors):
        out = block_attention_train(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_size=bs, impl="pallas",
                                    variant=variant, interpret=False)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    assert _export(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), variant, *shapes) == 4  # fwd, dq, dkv ctx, dkv blk


def test_scale_is_inverse_sqrt_head_dim():
    # One visible key per row and a zero query: the output is that key's value whatever the scale;
    # two keys with scores differing by sqrt(Dh) * x pin the scale.
    dh = 64
    q = jnp.zeros((1, 1, 1, dh)).at[..., 0].set(math.sqrt(dh))
    blk_k = jnp.zeros((1, 1, 1, dh)).at[..., 0].set(1.0)
    blk_v = jnp.ones((1, 1, 1, dh))
    ctx_k = jnp.zeros((1, 1, 8, dh))
    ctx_v = jnp.zeros((1, 1, 8, dh))
    out = fast_jit(block_attention_reference)(q, ctx_k, ctx_v, jnp.array([1]), blk_k, blk_v)
    # scores: block key 1.0, context key 0.0 -> weight of the block value = e / (e + 1)
    np.testing.assert_allclose(out[0, 0, 0, 0], math.e / (math.e + 1), rtol=1e-6)

"""Tree verification attention: both Pallas variants (interpret mode) against the reference.

Each kernel shape is compiled once and run on several random trees (chains,
bushes, a lone root) and cache lengths (0, full, in between); the trees are
runtime data. Shapes cover a root-only tree (N = 1, the AR step), node counts
that are and are not powers of two, GQA groups 1/2/4, head dims 64/128,
float32 and bfloat16.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import CUSTOM_CALLS, ON_CPU, compiled, export_for

from pallas_kernels.common import choose_kernel
from pallas_kernels.tree_attention import BlockSizes, tree_attention, tree_attention_reference

B = 4
TOL = {"float32": {"atol": 1e-5, "rtol": 1e-5}, "bfloat16": {"atol": 2e-2, "rtol": 2e-2}}
# name: (dtype, head_dim, heads, kv_heads, nodes, cache S, block_kv)
SHAPES = {
    "root-only-f32-g1": ("float32", 64, 4, 4, 1, 32, 16),
    "n8-f32-g2": ("float32", 128, 4, 2, 8, 48, 16),
    "n12-f32-g4": ("float32", 64, 8, 2, 12, 64, 32),
    "n16-bf16-g2": ("bfloat16", 64, 4, 2, 16, 48, 16),
}


def random_ancestors(rng, n, kind):
    """bool [n, n] ancestor masks (self included) of a random tree whose parents precede children."""
    if kind == "chain":
        parents = np.arange(n) - 1
    elif kind == "bush":
        parents = np.array([-1] + [0] * (n - 1))
    else:
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


def cases(rng, n, cache_len):
    """(cache_lengths, ancestors) pairs for one shape."""
    edge = np.array([0, cache_len // 3, cache_len - 1, cache_len], np.int32)
    rand = rng.integers(0, cache_len + 1, B).astype(np.int32)
    kinds = [("random", "chain", "bush", "random"), ("chain",) * B, ("bush", "random", "random", "bush")]
    return [(lengths, np.stack([random_ancestors(rng, n, k) for k in ks]))
            for lengths, ks in zip((edge, rand, edge[::-1].copy()), kinds)]


def inputs(rng, dtype, heads, kv_heads, head_dim, n, cache_len):
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return (normal(B, heads, n, head_dim), normal(B, kv_heads, n, head_dim), normal(B, kv_heads, n, head_dim),
            normal(B, kv_heads, cache_len, head_dim), normal(B, kv_heads, cache_len, head_dim))


def with_case(arrays, case):
    lengths, anc = case
    return tuple(arrays) + (jnp.asarray(lengths), jnp.asarray(anc))


def kernel_options(variant, block_kv):
    if variant == "tpu" and ON_CPU:
        assert choose_kernel("pallas") == choose_kernel("pallas", "tpu", True)
        return {"impl": "pallas", "block_sizes": BlockSizes(block_kv)}
    sizes = BlockSizes(block_kv) if variant == "tpu" else BlockSizes(block_kv, num_warps=4, num_stages=2)
    return {"impl": "pallas", "variant": variant, "interpret": True, "block_sizes": sizes}


def example(shape):
    dtype, head_dim, heads, kv_heads, n, cache_len, _ = SHAPES[shape]
    rng = np.random.default_rng(0)
    arrays = inputs(rng, getattr(jnp, dtype), heads, kv_heads, head_dim, n, cache_len)
    return with_case(arrays, cases(rng, n, cache_len)[0])


@functools.cache
def kernel_for(shape, variant):
    return compiled(functools.partial(tree_attention, **kernel_options(variant, SHAPES[shape][6])),
                    *example(shape))


@functools.cache
def reference_for(shape):
    return compiled(tree_attention_reference, *example(shape))


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_reference(shape, variant):
    dtype, head_dim, heads, kv_heads, n, cache_len, _ = SHAPES[shape]
    kernel, reference = kernel_for(shape, variant), reference_for(shape)
    rng = np.random.default_rng(1)
    arrays = inputs(rng, getattr(jnp, dtype), heads, kv_heads, head_dim, n, cache_len)
    for case in cases(rng, n, cache_len):
        args = with_case(arrays, case)
        out, ref = kernel(*args), reference(*args)
        assert out.shape == (B, heads, n, head_dim) and out.dtype == arrays[0].dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                   err_msg=f"{shape}/{variant}", **TOL[dtype])


def test_reference_matches_brute_force():
    """The reference against a per-node loop over the definition (float64 numpy)."""
    rng = np.random.default_rng(2)
    heads, kv_heads, head_dim, n, cache_len = 4, 2, 8, 7, 6
    arrays = inputs(rng, jnp.float32, heads, kv_heads, head_dim, n, cache_len)
    lengths, anc = cases(rng, n, cache_len)[0]
    out = np.asarray(compiled(tree_attention_reference, *with_case(arrays, (lengths, anc)))(
        *with_case(arrays, (lengths, anc))))
    q, kn, vn, ck, cv = (np.asarray(x, np.float64) for x in arrays)
    group = heads // kv_heads
    for b in range(B):
        for i in range(n):
            for hd in range(heads):
                kv = hd // group
                keys = np.concatenate([ck[b, kv, :lengths[b]], kn[b, kv, anc[b, i]]])
                values = np.concatenate([cv[b, kv, :lengths[b]], vn[b, kv, anc[b, i]]])
                scores = keys @ q[b, hd, i] / np.sqrt(head_dim)
                w = np.exp(scores - scores.max())
                np.testing.assert_allclose(out[b, hd, i], w @ values / w.sum(), atol=1e-5, rtol=1e-5)


def test_matches_model_xla_path():
    """The TPU kernel against `models.layers.tree_attention` (the model's XLA form)."""
    from adaflash_jax.models.layers import tree_attention as model_tree_attention

    shape = "n12-f32-g4"
    kernel = kernel_for(shape, "tpu")
    model = compiled(functools.partial(model_tree_attention, impl="xla"), *example(shape))
    dtype, head_dim, heads, kv_heads, n, cache_len, _ = SHAPES[shape]
    rng = np.random.default_rng(3)
    arrays = inputs(rng, getattr(jnp, dtype), heads, kv_heads, head_dim, n, cache_len)
    for case in cases(rng, n, cache_len):
        args = with_case(arrays, case)
        np.testing.assert_allclose(np.asarray(kernel(*args)), np.asarray(model(*args)), **TOL[dtype])


def test_xla_and_auto_are_the_reference():
    args = example("n8-f32-g2")
    want = str(jax.make_jaxpr(tree_attention_reference)(*args))
    assert str(jax.make_jaxpr(functools.partial(tree_attention, impl="xla"))(*args)) == want
    if ON_CPU:
        assert str(jax.make_jaxpr(functools.partial(tree_attention, impl="auto"))(*args)) == want


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
def test_variant_lowers(variant):
    sds = jax.ShapeDtypeStruct
    n, heads, kv_heads, dh, s = 32, 8, 2, 128, 1024
    args = (sds((B, heads, n, dh), jnp.bfloat16), sds((B, kv_heads, n, dh), jnp.bfloat16),
            sds((B, kv_heads, n, dh), jnp.bfloat16), sds((B, kv_heads, s, dh), jnp.bfloat16),
            sds((B, kv_heads, s, dh), jnp.bfloat16), sds((B,), jnp.int32), sds((B, n, n), jnp.bool_))
    fn = functools.partial(tree_attention, impl="pallas", variant=variant, interpret=False)
    assert CUSTOM_CALLS[variant] in export_for(fn, variant, *args).mlir_module()


def test_bad_inputs_raise():
    args = list(example("n8-f32-g2"))
    for index, mutate, match in ((0, lambda a: a[0], "q must be"), (1, lambda a: a[:, :, :-1], "k_new"),
                                 (2, lambda a: a[:-1], "v_new"), (3, lambda a: a[..., :-1], "cache_k"),
                                 (4, lambda a: a[:, :, :-1], "cache_v"), (5, lambda a: a[:-1], "cache_lengths"),
                                 (5, lambda a: a.astype(jnp.float32), "cache_lengths"),
                                 (6, lambda a: a[:, :-1], "ancestors")):
        bad = list(args)
        bad[index] = mutate(bad[index])
        for impl in ("xla", "pallas"):
            with pytest.raises(ValueError, match=match):
                tree_attention(*bad, impl=impl, variant="tpu" if impl == "pallas" else None, interpret=True)
    with pytest.raises(ValueError, match="power-of-two divisor"):
        tree_attention(*example("n8-f32-g2")[:3], args[3][:, :, :40], args[4][:, :, :40], *args[5:],
                       impl="pallas", variant="gpu", interpret=True)
    with pytest.raises(TypeError, match="BlockSizes"):
        tree_attention(*args, impl="pallas", variant="tpu", interpret=True, block_sizes=512)

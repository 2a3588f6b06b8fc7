"""Fused verification head: kernel (interpret mode) vs the jnp reference, the sampler's
distribution, the acceptance rules, bad inputs, and lowering for TPU and CUDA from a CPU host."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import CUSTOM_CALLS, export_for, run_compiled

from adaflash_jax.decoding import verify_head as vh
from adaflash_jax.decoding.acceptance import greedy_accept, greedy_accept_ids
from pallas_kernels import fused_verify as fv
from pallas_kernels.counter_hash import gumbel_from_bits, uniform_from_bits

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
SMALL_TILES = {"tpu": fv.BlockSizes(token_tile=16, vocab_tile=128, vocab_splits=3),
               "gpu": fv.BlockSizes(token_tile=16, vocab_tile=128, vocab_splits=3, d_tile=32)}


def _inputs(n, d, v, dtype, layout, key=0):
    """Random h [n, d] and W (layout), draft ids with two out of range, exclude ids, counters (numpy)."""
    rng = np.random.default_rng(key)
    h = rng.standard_normal((n, d), np.float32).astype(dtype)
    w = (rng.standard_normal((d, v), np.float32) * (2.0 / np.sqrt(d))).astype(dtype)
    if layout == "vd":
        w = np.ascontiguousarray(w.T)
    draft = rng.integers(0, v, (n,)).astype(np.int32)
    draft[0], draft[1] = -1, v
    exclude = np.where(np.arange(n) % 3 == 0, -1, draft).astype(np.int32)
    counters = (1000 + 7 * np.arange(n)).astype(np.int32)
    return h, w, draft, exclude, counters


def _logits(h, w, layout):
    """float64 logits from the (possibly bfloat16) inputs' exact values."""
    w = np.asarray(w, np.float64)
    return np.asarray(h, np.float64) @ (w if layout == "dv" else w.T)


# variant, dtype, N, D, V, temperature, layout, block sizes (None = the variant's defaults)
CASES = [
    ("tpu", "float32", 37, 64, 1000, 0.0, "dv", "small"),
    ("tpu", "bfloat16", 21, 128, 700, 0.7, "vd", "small"),
    ("tpu", "float32", 5, 48, 130, 0.5, "dv", None),
    ("gpu", "float32", 37, 64, 1000, 0.7, "dv", "small"),
    ("gpu", "bfloat16", 21, 128, 700, 0.0, "vd", "small"),
    ("gpu", "bfloat16", 19, 64, 500, 1.3, "dv", "small"),
    ("gpu", "float32", 8, 48, 130, 0.5, "vd", "small"),  # D not a multiple of d_tile: masked chunk
]


@pytest.mark.parametrize("variant,dtype,n,d,v,temperature,layout,tiles", CASES)
def test_kernel_matches_reference(variant, dtype, n, d, v, temperature, layout, tiles):
    tol = TOL[dtype]
    h, w, draft, exclude, counters = _inputs(n, d, v, jnp.dtype(dtype), layout)
    sample_kw = {"temperature": temperature, "seed": 11, "exclude_ids": exclude} if temperature else {}
    block_sizes = SMALL_TILES[variant] if tiles else None

    def both(h, w, draft, counters):
        kw = dict(sample_kw, counters=counters) if temperature else {}
        kernel = fv.verify_head(h, w, draft, weight_layout=layout, impl="pallas", variant=variant, interpret=True,
                                block_sizes=block_sizes, **kw)
        noise = fv.gumbel_noise(fv.position_keys(11, counters), v)
        return kernel, fv.verify_head_reference(h, w, draft, weight_layout=layout, **kw), noise

    out, ref, noise = run_compiled(both, h, w, draft, counters)
    out, ref = (fv.VerifyHeadOut(*map(np.asarray, x)) for x in (out, ref))
    z = _logits(h, w, layout) * (np.float32(1.0) / np.float32(temperature) if temperature else 1.0)
    rows = np.arange(n)

    # argmax: exact where the top two logits are apart; otherwise the chosen logit is a maximum.
    top2 = np.sort(z, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > tol
    np.testing.assert_array_equal(out.argmax[clear], ref.argmax[clear])
    np.testing.assert_allclose(z[rows, out.argmax], z.max(-1), atol=tol, rtol=0)
    np.testing.assert_allclose(out.lse, ref.lse, atol=tol, rtol=tol)
    np.testing.assert_allclose(out.draft_logit, ref.draft_logit, atol=tol, rtol=tol)
    assert np.isneginf(out.draft_logit[:2]).all()  # ids -1 and V
    np.testing.assert_allclose(out.lse, np.log(np.exp(z).sum(-1)), atol=tol, rtol=tol)

    if not temperature:
        np.testing.assert_array_equal(out.sample, out.argmax)
        return
    if dtype == "float32":
        np.testing.assert_array_equal(out.sample, ref.sample)  # same counter-based noise, same draw
    scores = np.where(np.arange(v)[None, :] == exclude[:, None], -np.inf, z + np.asarray(noise))
    np.testing.assert_allclose(scores[rows, out.sample], scores.max(-1), atol=tol, rtol=0)
    assert not np.any(out.sample == exclude)


def test_samples_follow_softmax_of_tempered_logits():
    """Gumbel-max over many counters on a 6-token vocab: counts match softmax(logits / T), and
    with an excluded id, the softmax of the rest (chi-square at p = 0.001, fixed seed)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0], np.float32)
    temperature, n_half = 0.8, 2048
    d = 8
    w = np.zeros((d, logits.size), np.float32)
    w[0] = logits
    h = np.zeros((2 * n_half, d), np.float32)
    h[:, 0] = 1.0
    exclude = np.where(np.arange(2 * n_half) < n_half, -1, 0).astype(np.int32)

    def both(h, w, exclude):
        kw = {"temperature": temperature, "seed": 1234, "exclude_ids": exclude}
        return (fv.verify_head(h, w, None, impl="pallas", variant="tpu", interpret=True, **kw).sample,
                fv.verify_head_reference(h, w, None, **kw).sample)

    sample, ref = map(np.asarray, run_compiled(both, jnp.asarray(h), jnp.asarray(w), jnp.asarray(exclude)))
    np.testing.assert_array_equal(sample, ref)
    p = np.exp(logits / temperature - np.max(logits / temperature))
    p /= p.sum()
    residual = np.where(np.arange(logits.size) == 0, 0.0, p)
    residual /= residual.sum()
    for draws, probs, critical in ((sample[:n_half], p, 20.52), (sample[n_half:], residual, 18.47)):
        counts = np.bincount(draws, minlength=logits.size)
        keep = probs > 0
        expected = probs[keep] * draws.size
        chi2 = float(np.sum((counts[keep] - expected) ** 2 / expected))
        assert counts[~keep].sum() == 0
        assert chi2 < critical, (counts, expected, chi2)


def _drafted_block(b, bs_len, d, v, key):
    """hidden [B, Bs, D], W, drafts that follow the target's argmax up to a row-dependent miss, verify_len."""
    h, w, *_ = _inputs(b * bs_len, d, v, np.float32, "dv", key)
    best = np.argmax(_logits(h, w, "dv"), -1).reshape(b, bs_len)
    drafts = best[:, :-1].copy()
    for row in range(b):
        cut = row % bs_len
        if cut < bs_len - 1:
            drafts[row, cut] = (drafts[row, cut] + 1) % v
    verify_len = np.array([bs_len - (row % 2) for row in range(b)], np.int32)
    return h.reshape(b, bs_len, d), w, drafts.astype(np.int32), verify_len


def test_fused_greedy_matches_acceptance():
    b, bs_len, d, v = 6, 4, 64, 300
    hidden, w, drafts, verify_len = _drafted_block(b, bs_len, d, v, key=3)

    def both(hidden, w, drafts, verify_len):
        logits = jnp.einsum("bsd,dv->bsv", hidden, w, preferred_element_type=jnp.float32)
        return (vh.fused_verify(hidden, w, drafts, verify_len, impl="pallas", variant="gpu", interpret=True,
                                block_sizes=SMALL_TILES["gpu"]),
                greedy_accept(drafts, logits, verify_len))

    got, want = run_compiled(both, hidden, w, drafts, verify_len)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert len(set(np.asarray(want[0]).tolist())) > 1  # the rows exercise different lengths


def test_fused_sampled_kernel_matches_xla():
    b, bs_len, d, v = 5, 4, 64, 300
    hidden, w, drafts, verify_len = _drafted_block(b, bs_len, d, v, key=4)
    counters = (np.arange(b * bs_len, dtype=np.int32).reshape(b, bs_len) * 3 + 5)

    def both(hidden, w, drafts, verify_len, counters):
        kw = {"temperature": 1.0, "seed": 9, "counters": counters}
        return (vh.fused_verify(hidden, w, drafts, verify_len, impl="pallas", variant="tpu", interpret=True,
                                block_sizes=SMALL_TILES["tpu"], **kw),
                vh.fused_verify(hidden, w, drafts, verify_len, impl="xla", **kw))

    got, want = run_compiled(both, hidden, w, drafts, verify_len, counters)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_sampled_acceptance_is_lossless():
    """The emitted tokens of the fused rule follow the target: the first token ~ p_0, and the second,
    after d_1 was accepted, ~ p_1 (argmax drafts; chi-square at p = 0.001 over many rows, fixed seed)."""
    logits = np.array([[1.5, 1.0, 0.0, -0.5, -1.0, 0.3],
                       [0.2, -1.0, 1.2, 0.0, 0.8, -0.3],
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    b, bs_len, d = 6000, 3, 8
    w = np.zeros((d, logits.shape[1]), np.float32)
    w[:bs_len] = logits
    hidden = np.ascontiguousarray(np.broadcast_to(np.eye(d, dtype=np.float32)[:bs_len], (b, bs_len, d)))
    drafts = np.ascontiguousarray(np.broadcast_to(np.array([1, 2], np.int32), (b, 2)))
    verify_len = np.full((b,), bs_len, np.int32)
    fused = jax.jit(functools.partial(vh.fused_verify, temperature=1.0, seed=77, impl="xla"))
    accepted, nxt = map(np.asarray, fused(hidden, w, drafts, verify_len))
    first = np.where(accepted >= 1, drafts[:, 0], nxt)
    second = np.where(accepted >= 2, drafts[:, 1], nxt)[accepted >= 1]

    def chi2(draws, row):
        p = np.exp(logits[row] - logits[row].max())
        p /= p.sum()
        counts = np.bincount(draws, minlength=p.size)
        return float(np.sum((counts - p * draws.size) ** 2 / (p * draws.size)))

    assert chi2(first, 0) < 20.52
    assert second.size > 1000 and chi2(second, 1) < 20.52


def test_accept_from_head_greedy_equals_greedy_accept_ids():
    b, bs_len, d, v = 8, 5, 32, 50
    hidden, w, drafts, verify_len = _drafted_block(b, bs_len, d, v, key=5)

    @jax.jit
    def both(hidden, w, drafts, verify_len):
        head = fv.verify_head_reference(hidden, w)
        return (vh.accept_from_head(head, drafts, verify_len, greedy=True),
                greedy_accept_ids(drafts, head.argmax, verify_len))

    got, want = both(hidden, w, drafts, verify_len)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_verify_head_ids_and_sampled_acceptance_edges():
    drafts = np.array([[4, 5, 6], [7, 8, 9]], np.int32)
    samples = np.array([[10, 11, 12, 13], [20, 21, 22, 23]], np.int32)

    @jax.jit
    def run(drafts, samples):
        ids = vh.verify_head_ids(drafts, jnp.array([4, 2]))
        keys = fv.position_keys(0, jnp.arange(8).reshape(2, 4))
        zeros = jnp.zeros((2, 4), jnp.float32)
        sure = fv.VerifyHeadOut(jnp.zeros((2, 4), jnp.int32), zeros, zeros, samples)  # p(draft) = 1
        never = sure._replace(draft_logit=jnp.full((2, 4), -jnp.inf))                 # p(draft) = 0
        return (ids, vh.accept_from_head(sure, drafts, jnp.array([4, 2]), greedy=False, keys=keys),
                vh.accept_from_head(never, drafts, jnp.array([4, 1]), greedy=False, keys=keys))

    (draft_ids, exclude_ids), sure, never = run(drafts, samples)
    np.testing.assert_array_equal(draft_ids, [[4, 5, 6, -1], [7, 8, 9, -1]])
    np.testing.assert_array_equal(exclude_ids, [[4, 5, 6, -1], [7, -1, -1, -1]])
    # every verified draft accepted; next = the plain sample at verify_len - 1
    np.testing.assert_array_equal(sure[0], [3, 1])
    np.testing.assert_array_equal(sure[1], [13, 21])
    # nothing accepted; next = the residual sample at position 0
    np.testing.assert_array_equal(never[0], [0, 0])
    np.testing.assert_array_equal(never[1], [10, 20])


def test_uniforms_and_noise_are_counter_based():
    @jax.jit
    def draw(seed, counters):
        keys = fv.position_keys(seed, counters)
        return keys, fv.acceptance_uniforms(keys), fv.gumbel_noise(keys[:64], 512)

    keys, u, g = map(np.asarray, draw(5, np.arange(4096)))
    assert len(np.unique(keys)) == 4096
    assert 0.0 < u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.02
    np.testing.assert_array_equal(draw(5, np.arange(4096))[0], keys)
    assert not np.array_equal(draw(6, np.arange(4096))[0], keys)
    assert abs(g.mean() - 0.5772) < 0.05 and abs(g.var() - np.pi ** 2 / 6) < 0.1
    # the extreme bit patterns stay strictly inside (0, 1) and give finite Gumbel noise
    extremes = np.array([0, -1, 2 ** 31 - 1, -2 ** 31, 511, -512], np.int32)
    u_ext = np.asarray(jax.jit(uniform_from_bits)(extremes))
    assert (u_ext > 0).all() and (u_ext < 1).all()
    assert np.isfinite(np.asarray(jax.jit(gumbel_from_bits)(extremes))).all()


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_xla_and_auto_on_cpu_are_the_reference(impl):
    h, w, draft, exclude, counters = _inputs(12, 32, 90, np.float32, "dv")

    @jax.jit
    def both(h, w, draft, exclude, counters):
        kw = {"temperature": 0.9, "seed": 3, "counters": counters, "exclude_ids": exclude}
        greedy = fv.verify_head(h.reshape(3, 4, 32), w, draft.reshape(3, 4), impl=impl)
        return fv.verify_head(h, w, draft, impl=impl, **kw), fv.verify_head_reference(h, w, draft, **kw), greedy

    got, want, greedy = both(h, w, draft, exclude, counters)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert greedy.argmax.shape == (3, 4)
    np.testing.assert_array_equal(np.asarray(greedy.argmax).reshape(-1), np.argmax(_logits(h, w, "dv"), -1))


def test_block_sizes():
    for variant in ("tpu", "gpu"):
        fv.BlockSizes.for_variant(variant).validate(variant)
    with pytest.raises(ValueError, match="positive int"):
        fv.BlockSizes(token_tile=0, vocab_tile=128)
    with pytest.raises(ValueError, match="multiple of 128"):
        fv.BlockSizes(token_tile=16, vocab_tile=100).validate("tpu")
    with pytest.raises(ValueError, match="power of two"):
        fv.BlockSizes(token_tile=24, vocab_tile=128).validate("gpu")
    with pytest.raises(ValueError, match="unknown kernel variant"):
        fv.BlockSizes.for_variant("cpu")


def test_bad_inputs_raise():
    h, w, draft, exclude, _ = _inputs(6, 16, 40, np.float32, "dv")
    call = functools.partial(fv.verify_head, impl="xla")
    cases = [
        (lambda: call(h, w, draft, weight_layout="nd"), "weight_layout"),
        (lambda: call(h, w.T, draft), "does not match"),
        (lambda: call(h.astype(np.int32), w, draft), "bfloat16, float16 or float32"),
        (lambda: call(h, w, draft[:5]), "draft_ids must have shape"),
        (lambda: call(h, w, draft.astype(np.float32)), "integer"),
        (lambda: call(h, w, draft, temperature=-1.0), "temperature"),
        (lambda: call(h, w, draft, temperature=0.5), "needs a seed"),
        (lambda: call(h, w, draft, temperature=0.5, seed=1.5), "seed"),
        (lambda: call(h, w, draft, exclude_ids=exclude), "only apply when sampling"),
        (lambda: call(h[:0], w, draft[:0]), "no positions"),
        (lambda: fv.verify_head(h, w, draft, impl="triton"), "unknown kernel impl"),
        (lambda: fv.verify_head(h, w, draft, impl="pallas", variant="npu"), "unknown kernel variant"),
        (lambda: fv.verify_head(h, w, draft, impl="pallas", variant="tpu", interpret=True,
                                block_sizes=fv.BlockSizes(12, 128)), "multiple of 8"),
        (lambda: fv.verify_head(h, w, draft, impl="pallas", block_sizes=(16, 128)), "BlockSizes"),
        (lambda: vh.fused_verify(h, w, draft, np.ones((6,), np.int32)), r"\[B, Bs, D\]"),
        (lambda: vh.fused_verify(h.reshape(2, 3, 16), w, np.zeros((2, 3), np.int32), np.ones((2,), np.int32)),
         "drafts must be"),
        (lambda: vh.accept_from_head(fv.verify_head_reference(h.reshape(2, 3, 16), w), np.zeros((2, 2), np.int32),
                                     np.ones((2,), np.int32), greedy=False), "position keys"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(fn)  # the checks run while tracing; nothing is compiled
    with pytest.raises(ValueError, match=r"2\*\*24"):
        jax.eval_shape(lambda h, w: fv.verify_head(h, w, impl="xla"), jax.ShapeDtypeStruct((4, 16), jnp.bfloat16),
                       jax.ShapeDtypeStruct((16, 1 << 24), jnp.bfloat16))


# Lowering at a Qwen3-sized head (V = 151,936, not a multiple of the vocab tile) from this CPU host.
@pytest.mark.parametrize("variant", ["tpu", "gpu"])
@pytest.mark.parametrize("sample,layout", [(False, "vd"), (True, "dv")])
def test_lowers_for_accelerator(variant, sample, layout):
    n, d, v = 256, 1024, 151936

    def fn(h, w, draft, exclude, counters):
        kw = {"temperature": 0.8, "seed": 1, "counters": counters, "exclude_ids": exclude} if sample else {}
        return fv.verify_head(h, w, draft, weight_layout=layout, impl="pallas", variant=variant, interpret=False,
                              **kw)

    w_shape = (d, v) if layout == "dv" else (v, d)
    args = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)]
    args += [jax.ShapeDtypeStruct((n,), jnp.int32)] * 3
    # The Triton call target is not on jax.export's stable list; the lowering itself is what we check.
    exported = export_for(fn, variant, *args)
    assert CUSTOM_CALLS[variant] in exported.mlir_module()
    assert [o.shape for o in exported.out_avals] == [(n,)] * 4

"""The OPD loss against a float64 numpy construction; chunking changes neither values nor gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.training.opd_loss import opd_loss

N, D, V = 37, 16, 50


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    h_s = rng.normal(size=(N, D)).astype(np.float32)
    h_t = rng.normal(size=(N, D)).astype(np.float32)
    w = (rng.normal(size=(D, V)) * 0.5).astype(np.float32)
    weights = (rng.random(N) * (rng.random(N) > 0.2)).astype(np.float32)  # some positions ignored
    return h_s, h_t, w, weights


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def numpy_opd(h_s, h_t, w, weights, alpha, temperature, clip, clip_mode):
    h_s, h_t, w, weights = (np.asarray(x, np.float64) for x in (h_s, h_t, w, weights))
    ls, lt = _log_softmax(h_s @ w / temperature), _log_softmax(h_t @ w / temperature)
    ce = -ls[np.arange(N), lt.argmax(-1)]
    kl = temperature ** 2 * (np.exp(ls) * (ls - lt)).sum(-1)
    n = weights.sum()
    kl_term = min((weights * kl).sum() / n, clip) if clip_mode == "mean" else (
        weights * np.minimum(kl, clip)).sum() / n
    return alpha * (weights * ce).sum() / n + (1 - alpha) * kl_term, (weights * kl).sum() / n


@pytest.mark.parametrize("alpha, temperature, clip, clip_mode", [
    (0.8, 1.0, 0.01, "mean"),  # the reference defaults: the KL term is clipped here
    (0.8, 1.0, 100.0, "mean"),  # unclipped
    (0.5, 2.0, 0.5, "token"),  # some positions clipped, some not
    (0.0, 1.0, 1e9, "token"),  # pure reverse KL
])
def test_matches_numpy(inputs, alpha, temperature, clip, clip_mode):
    loss, m = opd_loss(*map(jnp.asarray, inputs), alpha=alpha, temperature=temperature, clip=clip,
                       clip_mode=clip_mode, chunk=8)
    want, kl_mean = numpy_opd(*inputs, alpha, temperature, clip, clip_mode)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    np.testing.assert_allclose(float(m["reverse_kl"]), kl_mean, rtol=2e-5)


def test_token_clip_is_partial_and_mean_clip_kills_the_kl_gradient(inputs):
    h_s, h_t, w, weights = map(jnp.asarray, inputs)
    _, kl_mean = numpy_opd(*inputs, 0.0, 1.0, 1e9, "mean")
    grad = lambda **kw: jax.grad(lambda h: opd_loss(h, h_t, w, weights, alpha=0.0, **kw)[0])(h_s)  # noqa: E731
    assert float(jnp.abs(grad(clip=kl_mean / 2, clip_mode="mean")).max()) == 0.0
    g_tok = np.abs(np.asarray(grad(clip=kl_mean, clip_mode="token"))).sum(-1)
    assert (g_tok == 0).any() and (g_tok[np.asarray(weights) > 0] > 0).any()


def test_chunking_changes_neither_value_nor_gradient(inputs):
    h_s, h_t, w, weights = map(jnp.asarray, inputs)

    def run(chunk, remat=True):
        f = lambda hs, ww: opd_loss(hs, h_t, ww, weights, alpha=0.6, clip=1e9, chunk=chunk,  # noqa: E731
                                    remat=remat)[0]
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h_s, w)

    # 5 does not divide 37: padded last chunk. remat=False keeps the softmaxes instead.
    (v1, (g1, gw1)) = run(N)
    for v2, (g2, gw2) in (run(5), run(5, remat=False)):
        np.testing.assert_allclose(float(v2), float(v1), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(gw2), np.asarray(gw1), rtol=1e-5, atol=1e-7)
    # No gradient reaches the teacher's hidden states.
    gt = jax.grad(lambda ht: opd_loss(h_s, ht, w, weights, clip=1e9, chunk=5)[0])(h_t)
    assert float(jnp.abs(gt).max()) == 0.0


def test_chunked_loss_never_materialises_full_logits(inputs):
    h_s, h_t, w, weights = map(jnp.asarray, inputs)
    f = jax.jit(jax.grad(lambda hs: opd_loss(hs, h_t, w, weights, chunk=8)[0]))
    hlo = f.lower(h_s).compile().as_text()
    assert f"f32[{N},{V}]" not in hlo and f"f32[40,{V}]" not in hlo  # only [8, V] slabs


@pytest.mark.parametrize("kw, needle", [
    (dict(alpha=1.5), "alpha"), (dict(temperature=0.0), "temperature"), (dict(clip=-1.0), "clip"),
    (dict(clip_mode="max"), "clip_mode"),
])
def test_bad_settings_are_refused(inputs, kw, needle):
    with pytest.raises(ValueError, match=needle):
        opd_loss(*map(jnp.asarray, inputs), **kw)

"""The OPD loss against a float64 numpy transcription of the reference formula; the KL gradient
in the regime of a real run; a reduced draft vocabulary; chunking changes neither values nor
gradients."""

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


def reference_opd(h_s, h_t, w, weights, alpha, temperature, tau, d2t=None):
    """L = α·Σ w·CE(p_S, argmax p_T)/N + (1−α)·Σ_i w_i·min(T²·KL_i(p_S‖p_T)/N, τ), float64,
    position by position. With `d2t` the student lives on those columns only, the CE label is the
    teacher argmax's index among them and positions without one carry no CE."""
    h_s, h_t, w, weights = (np.asarray(x, np.float64) for x in (h_s, h_t, w, weights))
    cols = np.arange(w.shape[1]) if d2t is None else np.asarray(d2t)
    n = weights.sum()
    ce_sum = ce_w = kl_sum = kl_term = 0.0
    for i in range(len(weights)):
        ls = _log_softmax(h_s[i] @ w[:, cols] / temperature)
        lt = _log_softmax(h_t[i] @ w / temperature)
        kl_i = temperature ** 2 * float(np.sum(np.exp(ls) * (ls - lt[cols])))
        kl_sum += weights[i] * kl_i / n
        kl_term += weights[i] * (kl_i / n if tau is None else min(kl_i / n, tau))
        hits = np.flatnonzero(cols == lt.argmax())
        if hits.size:
            ce_sum += weights[i] * -ls[hits[0]]
            ce_w += weights[i]
    return alpha * ce_sum / ce_w + (1 - alpha) * kl_term, kl_sum


@pytest.mark.parametrize("alpha, temperature, tau", [
    (0.5, 1.0, None),  # the reference defaults: no clamp
    (0.8, 1.0, None),
    (0.5, 2.0, "median"),  # τ at the median KL/N: some positions clamped, some not
    (0.0, 1.0, "median"),  # pure reverse KL
])
def test_matches_the_reference_formula(inputs, alpha, temperature, tau):
    if tau == "median":
        tau = float(np.median(_per_position_kl(inputs, temperature)[inputs[3] > 0]))
    loss, m = opd_loss(*map(jnp.asarray, inputs), alpha=alpha, temperature=temperature, clip=tau, chunk=8)
    want, kl_mean = reference_opd(*inputs, alpha, temperature, tau)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    np.testing.assert_allclose(float(m["reverse_kl"]), kl_mean, rtol=2e-5)


def _per_position_kl(inputs, temperature):
    """T²·KL_i/N of every position (float64), to pick τ inside their range."""
    h_s, h_t, w, weights = (np.asarray(x, np.float64) for x in inputs)
    ls, lt = _log_softmax(h_s @ w / temperature), _log_softmax(h_t @ w / temperature)
    return temperature ** 2 * (np.exp(ls) * (ls - lt)).sum(-1) / weights.sum()


def test_the_default_is_the_reference(inputs):
    """Defaults: α 0.5, no clamp."""
    loss, _ = opd_loss(*map(jnp.asarray, inputs))
    np.testing.assert_allclose(float(loss), reference_opd(*inputs, 0.5, 1.0, None)[0], rtol=2e-5)


def test_batch_mean_clip_is_another_mode_and_differs(inputs):
    """clip_mode="mean" (not the reference's) clips the batch term: a different loss whenever
    the mean exceeds τ, and one without KL gradient."""
    h_s, h_t, w, weights = map(jnp.asarray, inputs)
    _, kl_mean = reference_opd(*inputs, 0.0, 1.0, None)
    tau = kl_mean / 2
    pos, _ = opd_loss(h_s, h_t, w, weights, alpha=0.0, clip=tau)
    mean, _ = opd_loss(h_s, h_t, w, weights, alpha=0.0, clip=tau, clip_mode="mean")
    np.testing.assert_allclose(float(mean), tau, rtol=1e-6)
    np.testing.assert_allclose(float(pos), reference_opd(*inputs, 0.0, 1.0, tau)[0], rtol=2e-5)
    assert float(pos) > tau * 1.01
    g = jax.grad(lambda h: opd_loss(h, h_t, w, weights, alpha=0.0, clip=tau, clip_mode="mean")[0])(h_s)
    assert float(jnp.abs(g).max()) == 0.0


@pytest.fixture(scope="module")
def real_run():
    """A real run's shape: 60 blocks of 16 with the DFlash weights (γ = 7, offset 0 excluded),
    so N ≈ 340; student and teacher several nats apart at every position."""
    rng = np.random.default_rng(1)
    blocks, bs, d, v = 60, 16, 32, 512
    k = np.arange(bs)
    weights = np.tile(np.where(k == 0, 0.0, np.exp(-(k - 1) / 7.0)), blocks).astype(np.float32)
    scale = rng.uniform(1.5, 4.0, size=(blocks * bs, 1))  # a spread of KLs across positions
    h_s = (rng.normal(size=(blocks * bs, d)) * scale).astype(np.float32)
    h_t = (rng.normal(size=(blocks * bs, d)) * scale).astype(np.float32)
    w = (rng.normal(size=(d, v)) / np.sqrt(d)).astype(np.float32)
    kl = _per_position_kl((h_s, h_t, w, weights), 1.0) * weights.sum()
    assert 100 < weights.sum() < 1000 and 3.0 < np.average(kl, weights=weights) < 20.0
    return h_s, h_t, w, weights, kl


@pytest.mark.parametrize("tau", [None, 0.01])
def test_kl_gradient_is_alive_in_a_real_run(real_run, tau):
    """With KL of several nats and N in the hundreds the KL term still trains: unclamped
    positions keep exactly their gradient (a batch-mean clip at 0.01 would zero it all)."""
    h_s, h_t, w, weights, kl = real_run
    n = weights.sum()
    hs, ht, ww, wt = map(jnp.asarray, (h_s, h_t, w, weights))
    grad = jax.grad(lambda h: opd_loss(h, ht, ww, wt, alpha=0.0, clip=tau, chunk=256)[0])(hs)
    per_pos = np.abs(np.asarray(grad)).sum(-1)
    live = (weights > 0) & (tau is None or kl / n < tau)
    assert live.sum() > 50 and (per_pos[live] > 0).all() and (per_pos[~live] == 0).all()
    if tau is not None:
        assert (kl[weights > 0] / n >= tau).sum() > 50  # the clamp does bite on other positions
        # Unclamped positions get exactly the unclamped loss's gradient (same N).
        free = jax.grad(lambda h: opd_loss(h, ht, ww, wt, alpha=0.0, chunk=256)[0])(hs)
        np.testing.assert_allclose(np.asarray(grad)[live], np.asarray(free)[live], rtol=1e-4, atol=1e-9)
        mean_clip = jax.grad(lambda h: opd_loss(h, ht, ww, wt, alpha=0.0, clip=tau, clip_mode="mean",
                                                chunk=256)[0])(hs)
        assert float(jnp.abs(mean_clip).max()) == 0.0  # what the batch-mean clip does here
    assert float(jnp.linalg.norm(grad)) > 1e-4


def test_reduced_draft_vocabulary_matches_the_formula_on_its_columns(inputs):
    h_s, h_t, w, weights = inputs
    teacher = _log_softmax(np.asarray(h_t, np.float64) @ w).argmax(-1)
    rng = np.random.default_rng(3)
    inside = np.unique(teacher)[::2]  # half the teacher argmaxes are draftable, half not
    rest = rng.choice(np.setdiff1d(np.arange(V), np.unique(teacher)), 12, replace=False)
    d2t = np.sort(np.concatenate([inside, rest])).astype(np.int32)
    has = np.isin(teacher, d2t)
    assert has.any() and (~has).any()
    for alpha, tau in ((0.5, None), (0.3, 0.3)):  # τ 0.3: about half the positions clamped
        loss, m = opd_loss(*map(jnp.asarray, inputs), d2t=jnp.asarray(d2t), alpha=alpha, clip=tau, chunk=8)
        want, kl_mean = reference_opd(*inputs, alpha, 1.0, tau, d2t=d2t)
        np.testing.assert_allclose(float(loss), want, rtol=2e-5)
        np.testing.assert_allclose(float(m["reverse_kl"]), kl_mean, rtol=2e-5)
    student = np.asarray(m["student_tokens"])
    assert np.isin(student, d2t).all()  # target ids, from the draft vocabulary
    z_s = np.asarray(h_s, np.float64) @ w[:, d2t]
    np.testing.assert_array_equal(student, d2t[z_s.argmax(-1)])


def test_chunking_changes_neither_value_nor_gradient(inputs):
    h_s, h_t, w, weights = map(jnp.asarray, inputs)

    def run(chunk, remat=True):
        f = lambda hs, ww: opd_loss(hs, h_t, ww, weights, alpha=0.6, chunk=chunk,  # noqa: E731
                                    remat=remat)[0]
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h_s, w)

    # 5 does not divide 37: padded last chunk. remat=False keeps the softmaxes instead.
    (v1, (g1, gw1)) = run(N)
    for v2, (g2, gw2) in (run(5), run(5, remat=False)):
        np.testing.assert_allclose(float(v2), float(v1), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(gw2), np.asarray(gw1), rtol=1e-5, atol=1e-7)
    # No gradient reaches the teacher's hidden states.
    gt = jax.grad(lambda ht: opd_loss(h_s, ht, w, weights, chunk=5)[0])(h_t)
    assert float(jnp.abs(gt).max()) == 0.0


def test_chunked_loss_never_materialises_full_logits(inputs):
    h_s, h_t, w, weights = map(jnp.asarray, inputs)
    f = jax.jit(jax.grad(lambda hs: opd_loss(hs, h_t, w, weights, chunk=8)[0]))
    hlo = f.lower(h_s).compile().as_text()
    assert f"f32[{N},{V}]" not in hlo and f"f32[40,{V}]" not in hlo  # only [8, V] slabs


@pytest.mark.parametrize("kw, needle", [
    (dict(alpha=1.5), "alpha"), (dict(temperature=0.0), "temperature"), (dict(clip=-1.0), "clip"),
    (dict(clip_mode="max"), "clip_mode"), (dict(clip_mode="token"), "clip_mode"),
])
def test_bad_settings_are_refused(inputs, kw, needle):
    with pytest.raises(ValueError, match=needle):
        opd_loss(*map(jnp.asarray, inputs), **kw)

"""The target distribution (temperature, top-p) and seeded sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adaflash_jax as af
from adaflash_jax.decoding.sampling import SamplingParams, sample_next, target_log_probs, token_keys
from fixtures import tiny_config, tiny_target

target_log_probs_jit = jax.jit(target_log_probs)


def numpy_nucleus(logits, temperature, top_p):
    """float64 reference: smallest prefix of the sorted distribution whose mass reaches top_p."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass_before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(p.shape, bool)
    keep[order[mass_before < top_p]] = True
    q = np.where(keep, p, 0.0)
    with np.errstate(divide="ignore"):
        return keep, np.log(q / q.sum())


def boundary_free_top_p(logits, temperature, k):
    """A top_p halfway between the k-th and (k+1)-th cumulative mass: the nucleus has k tokens."""
    z = logits.astype(np.float64) / temperature
    p = np.sort(np.exp(z - z.max()))[::-1]
    cum = np.cumsum(p / p.sum())
    return float((cum[k - 2] + cum[k - 1]) / 2) if k > 1 else float(cum[0] / 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.8])
@pytest.mark.parametrize("k", [1, 2, 5, 40])
def test_top_p_keeps_exactly_the_nucleus(temperature, k):
    rng = np.random.default_rng(k)
    logits = (3 * rng.standard_normal((3, 300))).astype(np.float32)
    for row in logits:
        top_p = boundary_free_top_p(row, temperature, k)
        keep, expected = numpy_nucleus(row, temperature, top_p)
        assert keep.sum() == k
        got = np.asarray(target_log_probs_jit(jnp.asarray(row), temperature, top_p))
        assert (np.isfinite(got) == keep).all()
        np.testing.assert_allclose(got[keep], expected[keep], rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.exp(got[keep]).sum(), 1.0, rtol=1e-5)


def test_top_p_one_keeps_every_token():
    """Even tokens of probability far below float32 epsilon stay in the support."""
    logits = (8 * np.random.default_rng(0).standard_normal((4, 300))).astype(np.float32)
    got = np.asarray(target_log_probs_jit(jnp.asarray(logits), 1.0, 1.0))
    assert np.isfinite(got).all()
    expected = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_a_full_nucleus_row_is_the_same_whether_or_not_another_row_filters():
    """The sort runs only when some row has top_p < 1; the other rows' numbers never change."""
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, 50)), jnp.float32)
    alone = np.asarray(target_log_probs_jit(logits, 0.7, jnp.ones((3, 1))))
    mixed = np.asarray(target_log_probs_jit(logits, 0.7, jnp.asarray([[1.0], [0.3], [1.0]])))
    np.testing.assert_array_equal(mixed[[0, 2]], alone[[0, 2]])
    assert np.isinf(mixed[1]).any() and np.isfinite(alone).all()


def test_ties_at_the_boundary_are_kept():
    logits = jnp.log(jnp.asarray([0.4, 0.2, 0.2, 0.2]))
    got = np.asarray(target_log_probs_jit(logits, 1.0, 0.5))
    assert np.isfinite(got).tolist() == [True, True, True, True]
    got = np.asarray(target_log_probs_jit(logits, 1.0, 0.3))
    assert np.isfinite(got).tolist() == [True, False, False, False]


def test_samples_follow_the_target_distribution():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0, -3.0]])
    top_p, n = 0.9, 4000
    keys = jax.random.split(jax.random.key(0), n)
    draw = jax.jit(jax.vmap(lambda k: sample_next(logits, k[None], False, 1.0, top_p)[0]))
    counts = np.bincount(np.asarray(draw(keys)), minlength=5)
    probs = np.exp(np.asarray(target_log_probs(logits[0], 1.0, top_p)))
    assert counts[probs == 0].sum() == 0
    sigma = np.sqrt(n * probs * (1 - probs))
    assert (np.abs(counts - n * probs) <= 4 * sigma + 1).all(), (counts, n * probs)


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((5, 50)), jnp.float32)
    keys = token_keys(jax.random.key(0), jnp.arange(5), 0)
    assert (np.asarray(sample_next(logits, keys, True, 1.0, 1.0)) == np.argmax(logits, -1)).all()


def test_token_keys_depend_only_on_row_and_index():
    seed = jax.random.key(3)
    a = jax.random.key_data(token_keys(seed, jnp.arange(4), jnp.asarray([0, 1, 2, 3])))
    b = jax.random.key_data(token_keys(seed, jnp.asarray([2]), jnp.asarray([2])))
    np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(b[0]))
    assert len({tuple(np.asarray(k).ravel()) for k in a}) == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p=-0.5), "top_p"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def target():
    return tiny_target(tiny_config(), seed=2)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 256, n).tolist() for n in (4, 11, 7)]


def sample(target, prompts, **kwargs):
    kwargs = {"max_new_tokens": 20, "temperature": 1.0, "stop_token_ids": [], **kwargs}
    return af.generate(target, prompts, **kwargs).token_ids


def test_sampling_reproducible_for_a_seed(target, prompts):
    assert sample(target, prompts, seed=11) == sample(target, prompts, seed=11)


def test_sampling_differs_across_seeds(target, prompts):
    runs = [sample(target, prompts, seed=s) for s in (0, 1, 2)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert all(a != b for a, b in zip(runs[i], runs[j]))
    greedy = sample(target, prompts, temperature=0.0)
    assert all(r != greedy for r in runs)


def test_first_row_sample_does_not_depend_on_the_rest_of_the_batch(target, prompts):
    assert sample(target, prompts[:1], seed=4)[0] == sample(target, prompts, seed=4)[0]


def test_tiny_top_p_reduces_to_greedy(target, prompts):
    assert sample(target, prompts, seed=9, top_p=1e-6) == sample(target, prompts, temperature=0.0)

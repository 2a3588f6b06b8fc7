"""Tree sampling is lossless: recursive rejection over siblings keeps the target's distribution.

Unit level: one step over a hand-made tree, with node distributions that put
real mass on the children (and zero mass on some tokens, children included), is
drawn many times; the emitted sequences are compared with their exact
probabilities (product of the target distribution along the walk) by a
chi-square test. The same test with the residual renormalisation skipped
(`renormalise=False`) must fail: the statistic has power where the rule matters.
End to end: the first three tokens of `generate(verify="tree")` at T > 0 against
the exact joint distribution computed from the target's logits (the tiny target
rarely gives two siblings real mass there, so the power against a broken rule
comes from the unit-level test).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding.tree_accept import path_tokens, sibling_accept_probs, tree_sample_accept
from adaflash_jax.decoding.tree_build import DraftTree

stats = pytest.importorskip("scipy.stats")
ALPHA = 1e-3
V, DRAWS = 6, 60_000
# root -> nodes 1, 2, 3 (tokens 0, 1, 2); node 1 -> nodes 4, 5 (tokens 3, 0); node 2 -> node 6 (token 5)
TOKENS = [4, 0, 1, 2, 3, 0, 5]
PARENTS = [-1, 0, 0, 0, 1, 1, 2]
DEPTHS = [0, 1, 1, 1, 2, 2, 2]


def node_probs(with_zeros: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(V, 1.5), size=len(TOKENS))
    p[0, :3] = [0.35, 0.25, 0.15]  # the root's children carry most of its mass
    if with_zeros:
        p[0, 2] = 0.0  # a child the target can never emit
        p[1, [1, 4]] = 0.0  # tokens outside the nucleus
    return p / p.sum(-1, keepdims=True)


def exact_sequences(p: np.ndarray, max_depth: int) -> dict:
    """Every sequence one step can emit -> its probability under the target."""
    out = {}

    def walk(node, prefix, prob):
        kids = {TOKENS[j]: j for j in range(len(TOKENS)) if PARENTS[j] == node}
        for x in range(V):
            if p[node, x] == 0:
                continue
            if x in kids and DEPTHS[node] < max_depth:
                walk(kids[x], prefix + (x,), prob * p[node, x])
            else:
                out[prefix + (x,)] = out.get(prefix + (x,), 0.0) + prob * p[node, x]

    walk(0, (), 1.0)
    return out


@functools.partial(jax.jit, static_argnames=("renormalise",))
def draw_step(logp, keys, renormalise=True):
    n = keys.shape[0]
    tree = DraftTree(*(jnp.broadcast_to(jnp.asarray(x, dt), (n, len(TOKENS))) for x, dt in (
        (TOKENS, jnp.int32), (PARENTS, jnp.int32), (DEPTHS, jnp.int32), ([0.0] * len(TOKENS), jnp.float32),
        ([True] * len(TOKENS), bool))))
    path, accepted, nxt = tree_sample_accept(tree, jnp.broadcast_to(logp, (n,) + logp.shape), keys, 2,
                                             renormalise=renormalise)
    return path_tokens(tree, path, accepted, nxt), accepted


def goodness_of_fit(observed: dict, expected: dict) -> float:
    """Chi-square p-value of sequence counts against exact probabilities (cells < 5 expected pooled)."""
    assert set(observed) <= set(expected), set(observed) - set(expected)  # nothing impossible was emitted
    n = sum(observed.values())
    cells = sorted(expected)
    obs = np.asarray([observed.get(c, 0) for c in cells], np.float64)
    exp = np.asarray([expected[c] * n for c in cells])
    big = exp >= 5
    if not big.all():
        obs, exp = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def sample_counts(p: np.ndarray, renormalise: bool, seed: int = 0) -> dict:
    with np.errstate(divide="ignore"):
        logp = jnp.asarray(np.log(p), jnp.float32)
    keys = jax.random.split(jax.random.key(seed), DRAWS)
    tokens, accepted = (np.asarray(x) for x in draw_step(logp, keys, renormalise=renormalise))
    counts = {}
    for row, a in zip(tokens, accepted):
        seq = tuple(int(t) for t in row[:a + 1])
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.mark.parametrize("with_zeros", [False, True])
def test_tree_rule_matches_exact_distribution(with_zeros):
    p = node_probs(with_zeros)
    pvalue = goodness_of_fit(sample_counts(p, True), exact_sequences(p, 2))
    print(f"tree rule, zeros={with_zeros}: p={pvalue:.3g}")
    assert pvalue > ALPHA


@pytest.mark.parametrize("with_zeros", [False, True])
def test_skipping_the_residual_renormalisation_is_detected(with_zeros):
    p = node_probs(with_zeros)
    pvalue = goodness_of_fit(sample_counts(p, False), exact_sequences(p, 2))
    print(f"broken tree rule, zeros={with_zeros}: p={pvalue:.3g}")
    assert pvalue < 1e-9


def test_sibling_accept_probs_telescope():
    """P(first acceptance at sibling i) = p(c_i): the closed form behind the rule."""
    p_kids = jnp.asarray([0.35, 0.0, 0.25, 0.15, 0.25])  # children cover all mass: the last accepts surely
    r = np.asarray(sibling_accept_probs(p_kids))
    reach = np.cumprod(np.append(1.0, 1.0 - r[:-1]))
    np.testing.assert_allclose(reach * r, np.asarray(p_kids), atol=1e-6)
    assert r[1] == 0.0 and abs(r[-1] - 1.0) < 1e-6


# ------------------------------------------------------------------ end to end through generate

PROMPT = H.TEST_PROMPTS[0] + [13, 13]
TEMPERATURE, ROWS, SEEDS, NEW, BUDGET = 0.05, 1024, (0, 1, 2, 3), 3, 40  # a budget deep and wide enough to branch


@pytest.fixture(scope="module")
def exact_joint(target):
    """P(t1, t2, t3 | PROMPT) as a [V, V, V] array (temperature only)."""
    v, n = target.cfg.vocab_size, len(PROMPT)
    ids = np.asarray([PROMPT + [a, b] for a in range(v) for b in range(v)], np.int32)
    z = target.score(ids).astype(np.float64) / TEMPERATURE
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p[0, n - 1][:, None, None] * p[::v, n][:, :, None] * p[:, n + 1].reshape(v, v, v)


def draw_joint(target, drafter):
    v = target.cfg.vocab_size
    counts = np.zeros((v, v, v), np.int64)
    for seed in SEEDS:
        res = af.generate(target, [PROMPT] * ROWS, drafter=drafter, temperature=TEMPERATURE, seed=seed,
                          max_new_tokens=NEW, stop_token_ids=(), verify="tree", tree_budget=BUDGET)
        np.add.at(counts, tuple(np.asarray(res.token_ids).T), 1)
    return counts


def joint_pvalue(counts, probs):
    cells = {(i,): c for i, c in enumerate(counts.ravel())}
    return goodness_of_fit({k: c for k, c in cells.items() if c}, {(i,): q for i, q in enumerate(probs.ravel())})


def test_generate_tree_sampling_matches_exact_distribution(target, exact_joint):
    pvalue = joint_pvalue(draw_joint(target, H.distilled_drafter()), exact_joint)
    print(f"generate(verify='tree') T={TEMPERATURE}: p={pvalue:.3g}")
    assert pvalue > ALPHA


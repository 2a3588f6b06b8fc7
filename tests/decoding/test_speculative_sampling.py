"""Speculative sampling is lossless: its tokens follow the target's own distribution.

The first three generated tokens of a fixed prompt are drawn ROWS x SEEDS
times (rows get independent keys) and compared with the exact joint
distribution computed from the target's logits (chi-square goodness of fit,
cells with expected count < 5 pooled). AR sampling passes the same test,
which validates the harness; a deliberately wrong residual distribution must
fail it, which shows the statistic has power where it matters.
"""

import jax
import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding import acceptance, compile_cache

stats = pytest.importorskip("scipy.stats")

PROMPT = H.TEST_PROMPTS[0] + [13, 13]  # inside the trajectory the distilled drafter learnt
TEMPERATURE = 0.05  # moderately peaked: drafts are accepted about half of the time
ROWS, SEEDS, NEW = 1024, (0, 1, 2, 3), 3
ALPHA = 1e-3
# name -> (drafter, sample_drafts, verify_len, top_p, other generate kwargs)
CASES = {
    "argmax-drafts": ("distilled", False, None, 1.0, {}),
    "sampled-drafts-mixed-verify": ("distilled", True, [H.BLOCK, 2, 3, H.BLOCK] * (ROWS // 4), 1.0, {}),
    "sampled-random-drafts": ("random", True, None, 1.0, {}),
    # q is zero outside a reduced draft vocabulary (its argmax drafts too)
    "reduced-vocab-sampled-drafts": ("reduced", True, None, 1.0, {}),
    "reduced-vocab-argmax-drafts": ("reduced", False, None, 1.0, {}),
    "argmax-drafts-top-p": ("distilled", False, None, 0.8, {}),
    # counter-based sampling through the fused verify head (its XLA reference here)
    "verify-head": ("distilled", False, None, 1.0, {"verify_head": True}),
    "verify-head-packed": ("distilled-head", False, None, 1.0,
                          {"verify_head": True, "length_policy": "head", "rho": 8.0}),
    # "auto" picks lengths from the whole batch: sampled drafts keep only the distribution
    # (acceptance.py says why), argmax drafts the very tokens as well (tests/decoding/test_auto_feedback.py)
    "auto-sampled-drafts": ("distilled-head", True, None, 1.0, {"length_policy": "auto", "step_costs": "flat"}),
}


@pytest.fixture(scope="module")
def drafters(target):
    from flax import nnx

    from adaflash_jax.models.length_head import LengthHead

    head = LengthHead(target.cfg.hidden_size, 8, rngs=nnx.Rngs(0))
    return {"distilled": H.distilled_drafter(),
            "distilled-head": H.distilled_drafter().with_length_head(head),
            "random": af.init_drafter(target, num_layers=2, block_size=H.BLOCK, seed=11),
            "reduced": H.reduced_vocab_drafter()}


def nucleus_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Temperature then top-p (ties at the boundary kept), float64, last axis."""
    z = logits / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    srt = -np.sort(-p, axis=-1)
    keep = (np.cumsum(srt, -1) - srt) < top_p
    threshold = np.min(np.where(keep, srt, np.inf), -1, keepdims=True)
    p = np.where(p >= threshold, p, 0.0)
    return p / p.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def exact(target):
    """top_p -> exact P(t1, t2, t3 | PROMPT) as a [V, V, V] array."""
    v, n = target.cfg.vocab_size, len(PROMPT)
    ids = np.asarray([PROMPT + [a, b] for a in range(v) for b in range(v)], np.int32)
    logits = target.score(ids).astype(np.float64)
    out = {}
    for top_p in {c[3] for c in CASES.values()}:
        p1 = nucleus_probs(logits[0, n - 1], TEMPERATURE, top_p)
        p2 = nucleus_probs(logits[::v, n], TEMPERATURE, top_p)
        p3 = nucleus_probs(logits[:, n + 1], TEMPERATURE, top_p).reshape(v, v, v)
        out[top_p] = p1[:, None, None] * p2[:, :, None] * p3
    return out


def draw(target, *, top_p, **kw):
    """Counts [V, V, V] of the first three tokens, plus the first verify step's commits."""
    v = target.cfg.vocab_size
    counts, first_commits = np.zeros((v, v, v), np.int64), []
    if "drafter" in kw:
        kw.setdefault("verify", "chain")  # this file tests chain verification (the default is adaptive)
    for seed in SEEDS:
        res = af.generate(target, [PROMPT] * ROWS, temperature=TEMPERATURE, top_p=top_p, seed=seed,
                          max_new_tokens=NEW, stop_token_ids=(), **kw)
        toks = np.asarray(res.token_ids)
        assert toks.shape == (ROWS, NEW)
        np.add.at(counts, tuple(toks.T), 1)
        if "drafter" in kw:
            first_commits += [lens[0] for lens in res.stats["acceptance_lengths"]]
    return counts, np.asarray(first_commits)


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(chi-square p-value, total-variation distance) of counts against probs."""
    n = counts.sum()
    obs, exp = counts.ravel().astype(np.float64), probs.ravel() * n
    big = exp >= 5
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    pvalue = stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    return float(pvalue), float(0.5 * np.abs(counts.ravel() / n - probs.ravel()).sum())


def flat_costs(batch: int):
    """Step costs under which drafting always pays and verifying more costs nothing."""
    from adaflash_jax.decoding.packing import default_buckets
    from adaflash_jax.decoding.verify_plan import StepCosts

    k = len(default_buckets(batch, H.BLOCK))
    return StepCosts(jax.numpy.ones((k,), jax.numpy.float32), jax.numpy.float32(0.01), jax.numpy.float32(1.0))


def run_case(target, drafters, exact, name):
    kind, sample_drafts, verify_len, top_p, extra = CASES[name]
    if extra.get("step_costs") == "flat":
        extra = dict(extra, step_costs=flat_costs(ROWS))
    counts, first = draw(target, top_p=top_p, drafter=drafters[kind], sample_drafts=sample_drafts,
                         verify_len=verify_len, **extra)
    # both paths are exercised: the first draft is often accepted and often rejected
    rejected = float(np.mean(first == 1))
    assert 0.1 < rejected < 0.9, rejected
    return goodness_of_fit(counts, exact[top_p]) + (rejected,)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_ar_sampling_matches_exact_distribution(target, exact, top_p):
    counts, _ = draw(target, top_p=top_p)
    pvalue, tv = goodness_of_fit(counts, exact[top_p])
    print(f"AR top_p={top_p}: p={pvalue:.3g} TV={tv:.4f}")
    assert pvalue > ALPHA


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_matches_exact_distribution(target, drafters, exact, name):
    pvalue, tv, rejected = run_case(target, drafters, exact, name)
    print(f"speculative {name}: p={pvalue:.3g} TV={tv:.4f} first-draft rejections={rejected:.2f}")
    assert pvalue > ALPHA


@pytest.fixture
def wrong_residual(monkeypatch):
    """Sample rejections from p instead of norm(max(0, p - q)); fresh traces on both sides."""
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q: p)
    compile_cache.clear()
    jax.clear_caches()
    yield
    monkeypatch.undo()
    compile_cache.clear()
    jax.clear_caches()


@pytest.mark.parametrize("name", ["sampled-random-drafts"])
def test_wrong_residual_is_detected(target, drafters, exact, wrong_residual, name):
    pvalue, tv, _ = run_case(target, drafters, exact, name)
    print(f"wrong residual, {name}: p={pvalue:.3g} TV={tv:.4f}")
    assert pvalue < 1e-8


def patched(monkeypatch, module, name, fn, run):
    """run() with module.name replaced by fn, on fresh traces on both sides."""
    monkeypatch.setattr(module, name, fn)
    compile_cache.clear()
    jax.clear_caches()
    try:
        return run()
    finally:
        monkeypatch.undo()
        compile_cache.clear()
        jax.clear_caches()


def test_match_rule_emitting_a_fresh_draw_is_detected(target, drafters, exact, monkeypatch):
    """Argmax drafts accept while they equal the position's draw from p and emit that draw at
    the first mismatch; emitting a fresh draw from p instead (the analogue of sampling p after
    a rejection) must fail the test."""
    jnp, real = jax.numpy, acceptance.match_accept

    def fresh_on_mismatch(drafts, log_probs, verify_len, keys):
        accepted, _ = real(drafts, log_probs, verify_len, keys)
        other = jax.vmap(jax.vmap(lambda k: jax.random.fold_in(k, 1)))(keys)
        draws = jax.vmap(jax.vmap(jax.random.categorical))(other, log_probs).astype(jnp.int32)
        return accepted, jnp.take_along_axis(draws, accepted[:, None], axis=1)[:, 0]

    pvalue, tv, _ = patched(monkeypatch, acceptance, "match_accept", fresh_on_mismatch,
                            lambda: run_case(target, drafters, exact, "argmax-drafts"))
    print(f"match rule with a fresh draw: p={pvalue:.3g} TV={tv:.4f}")
    assert pvalue < 1e-8


def test_verify_head_sample_excluding_the_draft_is_detected(target, drafters, exact, monkeypatch):
    """The engine's verify head samples the full distribution and accepts on match; excluding
    the draft from the sample where a rejection is possible (the kernel-level residual form)
    while still accepting on match must fail the test."""
    from adaflash_jax.decoding import verify_head

    real = verify_head.verify_head_inputs

    def excluding(drafts, verify_len, *args):
        return real(drafts, verify_len, *args)._replace(
            exclude_ids=verify_head.verify_head_ids(drafts, verify_len)[1])

    # every draft is now rejected, so run_case's check that both paths run does not apply
    counts, _ = patched(monkeypatch, verify_head, "verify_head_inputs", excluding, lambda: draw(
        target, top_p=1.0, drafter=drafters["distilled"], verify_head=True))
    pvalue, tv = goodness_of_fit(counts, exact[1.0])
    print(f"verify head excluding the draft: p={pvalue:.3g} TV={tv:.4f}")
    assert pvalue < 1e-8

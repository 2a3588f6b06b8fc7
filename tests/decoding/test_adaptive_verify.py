"""Adaptive verification ("head" and "auto" length policies) stays lossless.

Per-row, per-step verify lengths go through the packed verify path; outputs
must equal AR token for token whatever the lengths, the bucket or whether a
step drafted at all. The distilled drafter carries a random length head, with
rho spanning short and full verification.
"""

import jax.numpy as jnp
import pytest
from flax import nnx

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target  # noqa: F401 (fixtures)
from adaflash_jax.decoding import verify_plan
from adaflash_jax.models.length_head import LengthHead

MAX_NEW = 60


@pytest.fixture(scope="module")
def drafter():
    return H.distilled_drafter().with_length_head(LengthHead(H.TINY.hidden_size, 16, rngs=nnx.Rngs(3)))


@pytest.fixture(scope="module")
def ar(target):
    return af.generate(target, H.TEST_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).token_ids


def spec(target, drafter, prompts=H.TEST_PROMPTS, **kw):
    return af.generate(target, prompts, drafter=drafter, max_new_tokens=MAX_NEW, stop_token_ids=(), verify="chain",
                       **kw)


def costs(verify, draft, ar=1.0):
    return verify_plan.StepCosts(jnp.asarray(verify, jnp.float32), jnp.float32(draft), jnp.float32(ar))


@pytest.mark.parametrize("rho", [0.15, 0.5, 1.3])
def test_head_policy_matches_ar(target, drafter, ar, rho):
    res = spec(target, drafter, length_policy="head", rho=rho)
    assert res.token_ids == ar
    st = res.stats
    assert st["length_policy"] == "head"
    assert 1 <= st["mean_verify_len"] <= H.BLOCK
    for toks, lens in zip(res.token_ids, st["acceptance_lengths"]):
        assert sum(lens) == len(toks) - 1
    if rho == 0.15:  # short verification: far fewer verified tokens than fixed-16
        assert st["mean_verify_len"] < 6


def test_head_policy_with_ragged_batch_and_stop_token(target, drafter, ar):
    order = [2, 0, 1]
    stop = ar[0][7]
    expected = [t[:t.index(stop) + 1] if stop in t else t for t in (ar[i] for i in order)]
    res = af.generate(target, [H.TEST_PROMPTS[i] for i in order], drafter=drafter, max_new_tokens=MAX_NEW,
                      stop_token_ids=[stop], length_policy="head", rho=0.6)
    assert res.token_ids == expected


def test_auto_policy_skips_drafting_when_it_never_pays(target, drafter, ar):
    buckets = af_buckets()
    res = spec(target, drafter, length_policy="auto", probe_every=4,
               step_costs=costs([1.0] * len(buckets), draft=100.0))
    assert res.token_ids == ar
    st = res.stats
    # only probes draft, ever rarer (steps 0, ~5, ~14, ~31): a losing drafter costs few steps
    assert 0 < st["drafted_step_fraction"] <= 0.1
    assert st["mean_verify_len"] < 3  # AR steps verify 1 token; probes (flat verify cost) all 16
    # the next call continues the backed-off probe schedule instead of starting over
    again = spec(target, drafter, length_policy="auto", probe_every=4,
                 step_costs=costs([1.0] * len(buckets), draft=100.0))
    assert again.token_ids == ar
    assert again.stats["drafted_step_fraction"] < st["drafted_step_fraction"]


def test_auto_policy_verifies_whole_blocks_when_verify_cost_is_flat(target, drafter, ar):
    buckets = af_buckets()
    res = spec(target, drafter, length_policy="auto", step_costs=costs([1.0] * len(buckets), draft=0.01))
    assert res.token_ids == ar
    assert res.stats["drafted_step_fraction"] == 1.0
    assert res.stats["mean_verify_len"] > 12  # flat cost: verifying more is free


def test_auto_policy_calibrates_and_stays_lossless(target, drafter, ar, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_COST_CACHE", str(tmp_path / "costs.json"))
    res = spec(target, drafter, length_policy="auto")
    assert res.token_ids == ar
    assert (tmp_path / "costs.json").exists()


def test_sampling_with_head_policy_runs_and_respects_lengths(target, drafter):
    res = spec(target, drafter, length_policy="head", rho=0.3, temperature=0.8, seed=3)
    assert all(len(t) == MAX_NEW for t in res.token_ids)
    assert res.stats["mean_verify_len"] < 8


def test_policy_defaults_and_errors(target, drafter):
    plain = H.distilled_drafter()
    assert spec(target, plain).stats["length_policy"] == "fixed"
    flat = costs([1.0] * len(af_buckets()), draft=0.01)
    assert spec(target, drafter, step_costs=flat).stats["length_policy"] == "auto"
    with pytest.raises(ValueError, match="length head"):
        spec(target, plain, length_policy="head")
    with pytest.raises(ValueError, match="unknown length_policy"):
        spec(target, drafter, length_policy="fast")
    with pytest.raises(ValueError, match="verify_len applies"):
        spec(target, drafter, length_policy="head", verify_len=4)
    with pytest.raises(ValueError, match="rho"):
        spec(target, drafter, length_policy="head", rho=0)
    with pytest.raises(ValueError, match="need a drafter"):
        af.generate(target, H.TEST_PROMPTS, length_policy="head")


def af_buckets():
    from adaflash_jax.decoding.packing import default_buckets

    return default_buckets(4, H.BLOCK)


def test_verify_head_option_is_validated():
    target, drafter = H.tiny_target(), H.distilled_drafter()
    with pytest.raises(ValueError, match="needs top_p=1"):
        af.generate(target, H.TEST_PROMPTS, drafter=drafter, temperature=0.5, top_p=0.9, verify_head=True)
    with pytest.raises(ValueError, match="sample_drafts"):
        af.generate(target, H.TEST_PROMPTS, drafter=drafter, temperature=0.5, sample_drafts=True,
                    verify_head=True)
    with pytest.raises(ValueError, match="need a drafter"):
        af.generate(target, H.TEST_PROMPTS, temperature=0.5, verify_head=True)
    with pytest.raises(ValueError, match="verify_head= only"):
        af.generate(target, H.TEST_PROMPTS, drafter=drafter, temperature=0.5, verify_head=True, fused_head=True)


def test_fused_head_is_the_deprecated_name_of_verify_head():
    """The former keyword still reaches the engine: its checks fire, under a DeprecationWarning."""
    target, drafter = H.tiny_target(), H.distilled_drafter()
    with pytest.warns(DeprecationWarning, match="verify_head"):
        with pytest.raises(ValueError, match="verify_head=True samples from the full distribution"):
            af.generate(target, H.TEST_PROMPTS, drafter=drafter, temperature=0.5, top_p=0.9, fused_head=True)

"""Step costs corrected by the decoder's own timings (`decoding.adaptive.online_costs`).

Runs that take longer than the calibration predicts raise that kind of step's cost, the
first runs stay near the calibration, a stall cannot push a scale past its range, and the
corrected costs keep the calibration's placement. `generate` corrects calibrated costs
only: costs a caller passes are used as they are.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target, drafter  # noqa: F401 (fixtures)
from adaflash_jax.decoding.adaptive import online_costs
from adaflash_jax.decoding.adaptive.packed_step import engine_shapes
from adaflash_jax.decoding.adaptive.online_costs import DECAY, PRIOR_STEPS, SCALE_RANGE, scales_for
from adaflash_jax.decoding.verify_plan import StepCosts

BASE = StepCosts(jnp.asarray([0.02, 0.03, 0.05], jnp.float32), jnp.float32(0.0), jnp.float32(0.01))


def test_runs_slower_than_calibrated_raise_their_kind_of_step_only():
    scales = scales_for("slow drafted steps", BASE)
    assert scales.scales() == (1.0, 1.0)
    scales.observe("spec", seconds=0.04, steps=1, predicted_s=0.02)  # one probe at twice its cost
    ar, drafted = scales.scales()
    assert ar == 1.0 and 1.0 < drafted < 2.0  # the prior keeps one run from moving it all the way
    for _ in range(30):
        scales.observe("spec", seconds=0.4, steps=10, predicted_s=0.2)
        scales.observe("ar", seconds=0.1, steps=10, predicted_s=0.0)
    ar, drafted = scales.scales()
    assert ar == pytest.approx(1.0) and drafted == pytest.approx(2.0, rel=0.02)
    costs = scales.apply(BASE)
    np.testing.assert_allclose(np.asarray(costs.verify_s), np.asarray(BASE.verify_s) * drafted, rtol=1e-6)
    assert float(costs.ar_s) == pytest.approx(0.01) and costs.verify_s.sharding == BASE.verify_s.sharding


def test_a_catch_up_run_is_ar_time_and_a_stall_is_clipped():
    scales = scales_for("stall", BASE)
    scales.observe("catch_up", seconds=0.005, steps=0, predicted_s=0.0)
    prior = PRIOR_STEPS * 0.01
    assert scales.scales()[0] == pytest.approx((DECAY * prior + 0.005) / (DECAY * prior))
    scales.observe("ar", seconds=100.0, steps=1, predicted_s=0.0)
    assert scales.scales()[0] == SCALE_RANGE[1]
    with pytest.raises(ValueError, match="unknown program"):
        scales.observe("tree", 1.0, 1, 0.0)


def test_scales_persist_per_setting_and_restart_with_a_new_calibration():
    first = scales_for("persist", BASE)
    first.observe("ar", seconds=1.0, steps=10, predicted_s=0.0)
    assert scales_for("persist", BASE) is first
    recalibrated = BASE._replace(ar_s=jnp.float32(0.02))
    assert scales_for("persist", recalibrated) is not first and scales_for("other", BASE) is not first


def test_generate_corrects_calibrated_costs_only(target, drafter, monkeypatch, tmp_path):
    monkeypatch.setenv("ADAFLASH_COST_CACHE", str(tmp_path / "costs.json"))
    online_costs._BY_SETTING.clear()
    kw = dict(max_new_tokens=12, stop_token_ids=())
    res = af.generate(target, H.TEST_PROMPTS[:2], drafter=drafter, **kw)
    assert res.token_ids == af.generate(target, H.TEST_PROMPTS[:2], **kw).token_ids
    scales = res.stats["cost_scales"]
    assert set(scales) == {"ar", "drafted"} and all(SCALE_RANGE[0] <= v <= SCALE_RANGE[1] for v in scales.values())
    assert len(online_costs._BY_SETTING) == 1
    shapes = engine_shapes(2, tuple(res.stats["tree_budgets"]))
    costs = StepCosts(jnp.full((len(shapes),), 2.0, jnp.float32), jnp.float32(0.0), jnp.float32(1.0))
    res = af.generate(target, H.TEST_PROMPTS[:2], drafter=drafter, step_costs=costs, **kw)
    assert "cost_scales" not in res.stats and len(online_costs._BY_SETTING) == 1

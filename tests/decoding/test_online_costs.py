"""Step costs corrected by the decoder's own timings (`decoding.adaptive.online_costs`).

Drafted runs that take longer than the calibration predicts raise the drafted steps' cost
relative to AR steps; a slow spell seen by one kind of run moves both prices, and whichever
kind runs keeps them current; the first runs stay near the calibration, a stall cannot push
a scale past its range, and the corrected costs keep the calibration's placement.
`generate` corrects calibrated costs only: costs a caller passes are used as they are.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target, drafter  # noqa: F401 (fixtures)
from adaflash_jax.decoding.adaptive import online_costs
from adaflash_jax.decoding.adaptive.packed_step import engine_shapes
from adaflash_jax.decoding.adaptive.online_costs import SCALE_RANGE, scales_for
from adaflash_jax.decoding.verify_plan import StepCosts

BASE = StepCosts(jnp.asarray([0.02, 0.03, 0.05], jnp.float32), jnp.float32(0.0), jnp.float32(0.01))


def test_drafted_runs_slower_than_calibrated_raise_drafted_steps_against_ar():
    scales = scales_for("slow drafted steps", BASE)
    assert scales.scales() == (1.0, 1.0)
    scales.observe("spec", seconds=0.04, steps=1, predicted_s=0.02)  # one probe at twice its cost
    ar, drafted = scales.scales()
    assert 1.0 <= ar < drafted < 2.0  # the prior keeps one run from moving it all the way
    for _ in range(60):
        scales.observe("spec", seconds=0.4, steps=10, predicted_s=0.2)
        scales.observe("ar", seconds=0.1, steps=10, predicted_s=0.0)
    ar, drafted = scales.scales()
    assert ar == pytest.approx(1.0, rel=0.01) and drafted / ar == pytest.approx(2.0, rel=0.01)
    costs = scales.apply(BASE)
    np.testing.assert_allclose(np.asarray(costs.verify_s), np.asarray(BASE.verify_s) * drafted, rtol=1e-6)
    assert float(costs.ar_s) == pytest.approx(0.01 * ar) and costs.verify_s.sharding == BASE.verify_s.sharding


def _alternate(scales, ar_speed: float, drafted_speed: float, rounds: int) -> None:
    """AR runs and drafted runs in turn, each taking `speed` times its calibrated seconds."""
    for _ in range(rounds):
        scales.observe("ar", seconds=0.1 * ar_speed, steps=10, predicted_s=0.0)
        scales.observe("spec", seconds=0.2 * drafted_speed, steps=10, predicted_s=0.2)


def test_a_slow_spell_seen_by_ar_runs_moves_both_prices_not_the_choice():
    scales = scales_for("slow spell", BASE)
    _alternate(scales, 1.0, 1.5, rounds=30)  # drafted steps cost 1.5x their calibration
    before = scales.scales()
    for _ in range(20):  # the machine slows down twice while only AR steps run
        scales.observe("ar", seconds=0.2, steps=10, predicted_s=0.0)
    ar, drafted = scales.scales()
    assert ar == pytest.approx(2.0, rel=0.05)
    # the relative price barely moves (the last drafted run tied the two factors together)
    assert drafted / ar == pytest.approx(before[1] / before[0], rel=0.03)


def test_drafting_keeps_the_ar_price_current():
    """After a slow spell seen only by AR runs, a decoder that drafts every step (so runs no
    AR step) still learns that the machine is fast again: AR steps are not left overpriced."""
    scales = scales_for("stale ar", BASE)
    _alternate(scales, 1.0, 1.0, rounds=30)
    for _ in range(10):
        scales.observe("ar", seconds=0.2, steps=10, predicted_s=0.0)
    assert scales.scales()[0] == pytest.approx(2.0, rel=0.05)
    for _ in range(30):
        scales.observe("spec", seconds=0.2, steps=10, predicted_s=0.2)
    ar, drafted = scales.scales()  # (scales per kind of run left AR at 1.84 here)
    assert drafted == pytest.approx(1.0, rel=0.05) and ar < 1.2


def test_a_catch_up_run_is_ar_time_and_a_stall_is_clipped():
    scales, together = scales_for("catch-up", BASE), scales_for("catch-up counted", BASE)
    scales.observe("catch_up", seconds=0.05, steps=0, predicted_s=0.0)
    assert scales.scales() == (1.0, 1.0)  # counted with the next AR run
    scales.observe("ar", seconds=0.1, steps=10, predicted_s=0.0)
    together.observe("ar", seconds=0.15, steps=10, predicted_s=0.0)
    assert scales.scales() == pytest.approx(together.scales()) and scales.scales()[0] > 1.0
    stepped = scales_for("catch-up and a step", BASE)  # the server's engine: a catch-up, then an AR step
    stepped.observe("catch_up", seconds=0.015, steps=1, predicted_s=0.0)
    assert stepped.scales()[0] > 1.0
    stalled = scales_for("stall", BASE)
    stalled.observe("ar", seconds=100.0, steps=1, predicted_s=0.0)
    assert stalled.scales() == pytest.approx((SCALE_RANGE[1], SCALE_RANGE[1]))
    stalled.observe("ar", seconds=0.1, steps=10, predicted_s=0.0)  # one run at the calibrated speed
    assert stalled.scales()[0] < 2.0
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
    lo, hi = SCALE_RANGE[0] ** 2, SCALE_RANGE[1] ** 2  # drafted: the speed times the relative cost
    assert set(scales) == {"ar", "drafted"} and all(lo <= v <= hi for v in scales.values())
    assert len(online_costs._BY_SETTING) == 1
    shapes = engine_shapes(2, tuple(res.stats["tree_budgets"]))
    costs = StepCosts(jnp.full((len(shapes),), 2.0, jnp.float32), jnp.float32(0.0), jnp.float32(1.0))
    res = af.generate(target, H.TEST_PROMPTS[:2], drafter=drafter, step_costs=costs, **kw)
    assert "cost_scales" not in res.stats and len(online_costs._BY_SETTING) == 1

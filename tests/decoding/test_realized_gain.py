"""The realized-gain factor (`decoding.adaptive.realized_gain`): what drafting delivered
against what the allocation expected, over drafted steps, applied to every expected gain."""

import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.decoding.adaptive import realized_gain as rg


def test_a_fresh_factor_is_one_and_moves_by_what_the_rows_that_drafted_delivered():
    gain = rg.RealizedGain.fresh()
    assert float(gain.factor()) == 1.0
    drafted = jnp.asarray([True, True, False])  # row 2 verified its root alone: not counted
    gain = gain.observe(jnp.asarray([1, 2, 0]), jnp.asarray([3.0, 3.0, 9.0]), drafted)
    assert float(gain.factor()) == pytest.approx((3 + rg.PRIOR_TOKENS) / (6 + rg.PRIOR_TOKENS))
    later = gain.observe(jnp.asarray([4, 0, 0]), jnp.asarray([2.0, 0.0, 0.0]), jnp.asarray([True, False, False]))
    realized, promised = rg.DECAY * 3 + 4, rg.DECAY * 6 + 2  # older steps count for less
    assert float(later.factor()) == pytest.approx((realized + rg.PRIOR_TOKENS) / (promised + rg.PRIOR_TOKENS))


def test_the_factor_stays_in_its_range():
    never = rg.RealizedGain(jnp.float32(0.0), jnp.float32(1e6))
    always = rg.RealizedGain(jnp.float32(1e6), jnp.float32(1.0))
    assert float(never.factor()) == rg.FACTOR_RANGE[0] and float(always.factor()) == rg.FACTOR_RANGE[1]


def test_generate_carries_the_sums_per_drafter_weights_and_sampling_mode():
    class Weights:  # stand-ins for two drafters' weight objects
        pass

    weights, other = Weights(), Weights()
    rg.keep(weights, True, rg.RealizedGain(jnp.float32(5.0), jnp.float32(10.0)))
    kept = rg.carried(weights, True)
    assert (float(kept.realized), float(kept.promised)) == (5.0, 10.0)
    for fresh in (rg.carried(weights, False), rg.carried(other, True)):
        assert np.asarray([fresh.realized, fresh.promised]).tolist() == [0.0, 0.0]

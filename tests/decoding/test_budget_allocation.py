"""Per-row budgets (`decoding.adaptive.allocation`): the greedy knapsack against brute force.

For concave expectations the greedy allocation is the best integral one for each packed
shape, so the chosen rate equals the best over every assignment of budgets to rows that
fits a shape (brute force over small batches); rows that are not live get nothing, and
rows whose drafts promise more get larger budgets.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.decoding.adaptive.allocation import (DRAFT_MARGIN, PROBE_OVERHEAD, SHADOW_OVERHEAD, allocate,
                                                      critical_rows, draft_advantage, drafted_probe_gap, drafting_pays,
                                                      expected_from_acceptance, probe_gap, probe_seconds,
                                                      uniform_shapes)
from adaflash_jax.decoding.verify_plan import StepCosts

BUDGETS = (1, 2, 4, 8)


def costs(values) -> StepCosts:
    return StepCosts(jnp.asarray(values, jnp.float32), jnp.float32(0.0), jnp.float32(values[0]))


def concave_expectations(rng, b):
    """E_b(n) with decreasing gains per node, as trees of falling path probabilities have."""
    rows = []
    for _ in range(b):
        p = rng.uniform(0.05, 0.95)
        per_node = p ** np.arange(1, 9)  # node k's path probability, falling
        cum = np.concatenate([[0.0], np.cumsum(per_node)])
        rows.append([cum[n - 1] for n in BUDGETS])
    return np.asarray(rows, np.float32)


def brute_force(expected, live, shapes, step_s):
    best = -1.0
    for levels in itertools.product(range(len(BUDGETS)), repeat=expected.shape[0]):
        counts = [BUDGETS[lv] if live[i] else 0 for i, lv in enumerate(levels)]
        commits = sum(1 + expected[i, lv] for i, lv in enumerate(levels) if live[i])
        for (tokens, width), s in zip(shapes, step_s):
            if sum(counts) <= tokens and max(counts) <= width:
                best = max(best, commits / s)
    return best


# uniform shapes, and shapes with a few tokens more than the batch at a large width
SHAPE_SETS = [uniform_shapes(3, BUDGETS), ((3, 1), (5, 8), (6, 2), (9, 8), (12, 4), (24, 8))]


@pytest.mark.parametrize("shapes", SHAPE_SETS)
@pytest.mark.parametrize("seed", range(6))
def test_greedy_allocation_matches_brute_force(seed, shapes):
    rng = np.random.default_rng(seed)
    expected = concave_expectations(rng, 3)
    live = np.asarray([True, True, seed % 2 == 0])
    step_s = np.cumsum(rng.uniform(0.05, 0.6, len(shapes))) + 1.0
    counts, shape, rate = allocate(jnp.asarray(expected), jnp.asarray(live), BUDGETS, shapes, costs(step_s))
    counts = np.asarray(counts)
    assert np.all(counts[~live] == 0) and np.all(counts[live] >= 1)
    tokens, width = shapes[int(shape)]
    assert counts.sum() <= tokens and counts.max() <= width
    want = brute_force(expected, live, shapes, step_s)
    np.testing.assert_allclose(float(rate), want, rtol=1e-5)
    commits = sum(1 + expected[i, BUDGETS.index(c)] for i, c in enumerate(counts) if live[i])
    np.testing.assert_allclose(commits / step_s[int(shape)], want, rtol=1e-5)


def test_rows_that_promise_more_get_larger_budgets():
    p = jnp.asarray([0.95, 0.05, 0.9, 0.1], jnp.float32)
    expected = expected_from_acceptance(p, BUDGETS, 16)
    shapes = ((4, 1), (8, 4), (16, 4), (32, 8))  # a shape of twice the batch at width 4
    counts, shape, _ = allocate(expected, jnp.ones((4,), bool), BUDGETS, shapes, costs([1.0, 1.2, 1.9, 3.0]))
    assert int(shape) == 1 and np.asarray(counts).tolist() == [4, 1, 2, 1]


def test_uniform_shapes_fill_every_row_whose_drafts_gain():
    p = jnp.asarray([0.95, 0.05, 0.9, 0.1], jnp.float32)
    expected = expected_from_acceptance(p, BUDGETS, 16)
    counts, shape, _ = allocate(expected, jnp.ones((4,), bool), BUDGETS, uniform_shapes(4, BUDGETS),
                                costs([1.0, 1.2, 1.5, 2.2]))
    assert np.asarray(counts).tolist() == [8, 8, 8, 8] and int(shape) == 3


def test_critical_rows_are_the_live_rows_with_the_most_left():
    live = jnp.asarray([True, True, True, False, True])
    remaining = jnp.asarray([40, 52, 52, 60, 7], jnp.int32)
    assert np.asarray(critical_rows(live, remaining)).tolist() == [False, True, True, False, False]
    assert not np.asarray(critical_rows(jnp.zeros((5,), bool), remaining)).any()


def test_makespan_drafts_only_when_the_slowest_critical_row_gains():
    """Throughput drafts for two easy rows; the batch still ends with the hard row, so under the
    makespan objective only its gain counts: no draft while it is critical, and once it is
    ahead the easy rows' drafts pay again."""
    p = jnp.asarray([0.9, 0.9, 0.05, 0.9], jnp.float32)
    live, dear = jnp.ones((4,), bool), costs([1.0, 1.3, 1.8, 3.0])
    assert bool(drafting_pays(p, live, BUDGETS, 16, dear))
    hard_row_last = critical_rows(live, jnp.asarray([30, 30, 40, 30], jnp.int32))
    assert not bool(drafting_pays(p, live, BUDGETS, 16, dear, critical=hard_row_last))
    hard_row_ahead = critical_rows(live, jnp.asarray([40, 40, 30, 40], jnp.int32))
    assert bool(drafting_pays(p, live, BUDGETS, 16, dear, critical=hard_row_ahead))


def test_makespan_gives_a_shape_s_nodes_to_the_critical_rows_first():
    p = jnp.asarray([0.95, 0.6, 0.9, 0.6], jnp.float32)
    expected = expected_from_acceptance(p, BUDGETS, 16)
    shapes = ((4, 1), (6, 4))  # two extra nodes at width 4
    critical = jnp.asarray([False, True, False, True])
    counts, shape, _ = allocate(expected, jnp.ones((4,), bool), BUDGETS, shapes, costs([1.0, 1.05]), critical)
    assert int(shape) == 1 and np.asarray(counts).tolist() == [1, 2, 1, 2]
    counts, _, _ = allocate(expected, jnp.ones((4,), bool), BUDGETS, shapes, costs([1.0, 1.05]))
    assert np.asarray(counts).tolist() == [2, 1, 2, 1]  # throughput: the likeliest drafts


def test_drafting_pays_only_when_some_row_gains():
    live = jnp.ones((4,), bool)
    cheap, dear = costs([1.0, 1.05, 1.1, 1.2]), costs([1.0, 3.0, 5.0, 9.0])
    high, low = jnp.full((4,), 0.9, jnp.float32), jnp.full((4,), 0.05, jnp.float32)
    assert bool(drafting_pays(high, live, BUDGETS, 16, cheap))
    assert not bool(drafting_pays(low, live, BUDGETS, 16, dear))
    assert not bool(drafting_pays(high, jnp.zeros((4,), bool), BUDGETS, 16, cheap))  # nothing live


def test_drafting_inside_the_margin_is_not_chosen_and_probed_as_a_small_loss():
    """An advantage the estimates put between 1 and 1 + DRAFT_MARGIN does not draft (the
    costs are not known that well), and near break-even is probed after a few AR steps, not
    every step."""
    live, p = jnp.ones((4,), bool), jnp.full((4,), 0.5, jnp.float32)
    _, even, _ = draft_advantage(p, live, BUDGETS, 16, costs([1.0] * 4))  # drafted steps priced as AR's
    for wanted, paid in ((1.0 + DRAFT_MARGIN / 10, False), (1.0 + 2 * DRAFT_MARGIN, True)):
        priced = StepCosts(jnp.full((4,), float(even) / wanted, jnp.float32), jnp.float32(0.0),
                           jnp.float32(1.0))  # every drafted step priced to give that ratio
        drafts, ratio, step_s = draft_advantage(p, live, BUDGETS, 16, priced)
        assert float(ratio) == pytest.approx(wanted, rel=1e-4) and bool(drafts)
        assert bool(drafting_pays(p, live, BUDGETS, 16, priced)) == paid
        gap = int(drafted_probe_gap(ratio, step_s, priced, jnp.int32(64)))
        assert gap > 1 if not paid else gap == 1


def test_probes_come_sooner_the_nearer_drafting_is_to_paying():
    """A probe's expected loss, spread over the AR steps before it, stays a PROBE_OVERHEAD
    share of the time; the doubling backoff bounds the gap from above."""
    live = jnp.ones((4,), bool)
    c = StepCosts(jnp.asarray([1.1, 1.3, 1.6, 2.2], jnp.float32), jnp.float32(0.0), jnp.float32(1.0))
    gaps = []
    for p in (0.05, 0.15, 0.2, 0.23):
        drafts, ratio, step_s = draft_advantage(jnp.full((4,), p, jnp.float32), live, BUDGETS, 16, c)
        assert float(ratio) < 1.0 and not bool(drafting_pays(jnp.full((4,), p), live, BUDGETS, 16, c))
        gap = int(drafted_probe_gap(ratio, step_s, c, jnp.int32(10_000)))
        loss = float(step_s) * (1 + DRAFT_MARGIN - float(ratio))  # a probe's loss against the margin
        assert loss / (gap * 1.0) <= PROBE_OVERHEAD + 1e-6 and loss / max(gap - 1, 1) > PROBE_OVERHEAD - 1e-6
        gaps.append(gap)
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < gaps[0]
    drafts, ratio, step_s = draft_advantage(jnp.full((4,), 0.05, jnp.float32), live, BUDGETS, 16, c)
    assert int(drafted_probe_gap(ratio, step_s, c, jnp.int32(2))) == 2  # never later than the backoff
    assert int(drafted_probe_gap(jnp.float32(1.5), step_s, c, jnp.int32(8))) == 1  # paying: no wait


def test_shadow_probes_cost_a_small_share_of_the_time():
    """A shadow probe adds the smallest drafted shape's cost over an AR step (at least 5% of
    one); spread over the AR steps before it, that is a SHADOW_OVERHEAD share of the time. The
    doubling backoff bounds the gap from above."""
    for smallest, ar in ((1.2, 1.0), (0.35, 0.25), (1.0, 1.0)):
        c = StepCosts(jnp.asarray([smallest, 2.0, 3.0], jnp.float32), jnp.float32(0.0), jnp.float32(ar))
        extra = max(smallest - ar, 0.05 * ar)
        assert float(probe_seconds(c)) == pytest.approx(extra)
        gap = int(probe_gap(c, jnp.int32(10_000)))
        assert extra / (gap * ar) <= SHADOW_OVERHEAD + 1e-6 and extra / (max(gap - 1, 1) * ar) > SHADOW_OVERHEAD - 1e-6
        assert int(probe_gap(c, jnp.int32(2))) == 2  # never later than the backoff


def test_calibrated_costs_are_made_monotone_in_the_work_done():
    """Noise never makes a drafted step cheaper than an AR step, or a shape cheaper than one
    it contains (no more tokens at no more width); costs already consistent are kept."""
    from adaflash_jax.decoding.adaptive.costs import monotone

    shapes = [(8, 1), (10, 4), (12, 8), (16, 2), (32, 4)]
    noisy = monotone(0.125, shapes, [0.16, 0.109, 0.12, 0.116, 0.175])
    assert noisy == [0.16, 0.16, 0.16, 0.16, 0.175]
    for (t, w), c in zip(shapes, noisy):
        assert c >= 0.125 and all(c >= o for (t2, w2), o in zip(shapes, noisy) if t2 <= t and w2 <= w)
    clean = [0.13, 0.14, 0.15, 0.145, 0.2]
    assert monotone(0.125, shapes, clean) == clean

"""The verify-length policy picks the argmax of expected committed tokens per second."""

import itertools

import numpy as np
import pytest

from adaflash_jax.decoding.length_policy import (CostModel, allocate, choose_packed, choose_uniform,
                                                 expected_commits, per_token_acceptance)

BS = 4


def compute_bound(batches=(1, 2, 3, 4), tokens=(1, 2, 3, 4), draft=0.3):
    """Verify cost grows with rows × tokens (a compute-bound target), plus a fixed overhead."""
    verify = tuple(tuple(0.2 + 0.25 * b * t for t in tokens) for b in batches)
    return CostModel(batches, tokens, verify, tuple(draft for _ in batches))


def memory_bound(block=16):
    tokens = tuple(range(1, block + 1))
    return CostModel((1, 8), tokens, tuple(tuple(1.0 + 0.001 * t for t in tokens) for _ in (1, 8)),
                     (0.1, 0.1))


def test_acceptance_model_inverts_expected_commits():
    m = np.asarray([1.0, 1.5, 3.0, 7.9, 16.0])
    p = per_token_acceptance(m, 16)
    np.testing.assert_allclose(expected_commits(p, 16), m, rtol=1e-6)
    assert p[0] == pytest.approx(0.0, abs=1e-9) and p[-1] == pytest.approx(1.0, abs=1e-6)


def _rate(p, lengths, cost):
    return float(expected_commits(p, np.asarray(lengths)).sum()) / cost


@pytest.mark.parametrize("scores", [[0.3, 0.9, 0.6], [1.0, 1.0, 1.0], [0.25, 0.25, 0.3], [0.5, 0.95, 0.8]])
def test_uniform_choice_is_the_brute_force_argmax(scores):
    costs = compute_bound()
    length, rate = choose_uniform(scores, BS, costs)
    p = per_token_acceptance(np.asarray(scores) * BS, BS)
    b = len(scores)
    rates = {1: _rate(p, [1] * b, costs.verify_s(b, 1))}
    rates.update({L: _rate(p, [L] * b, costs.draft_s(b) + costs.verify_s(b, L)) for L in range(2, BS + 1)})
    assert rate == pytest.approx(max(rates.values()))
    assert rates[length] == pytest.approx(rate)


@pytest.mark.parametrize("scores", [[0.3, 0.9, 0.6], [1.0, 0.25, 1.0], [0.25, 0.25, 0.3], [0.5, 0.95, 0.8]])
def test_packed_choice_is_the_brute_force_argmax(scores):
    costs, buckets = compute_bound(), (4, 6, 8, 12)
    lengths, rate = choose_packed(scores, BS, costs, buckets)
    p = per_token_acceptance(np.asarray(scores) * BS, BS)
    b = len(scores)
    best = _rate(p, [1] * b, costs.verify_s(b, 1))
    for bucket in buckets:
        if bucket <= b:
            continue
        for ls in itertools.product(range(1, BS + 1), repeat=b):
            if sum(ls) <= bucket:
                best = max(best, _rate(p, ls, costs.draft_s(b) + costs.verify_s(b, bucket / b)))
    assert rate == pytest.approx(best)
    assert all(1 <= x <= BS for x in lengths)


def test_greedy_allocation_is_optimal_for_its_budget():
    p = per_token_acceptance(np.asarray([0.3, 0.9, 0.6]) * BS, BS)
    for budget in range(3, 3 * BS + 1):
        got = expected_commits(p, allocate(p, budget, BS)).sum()
        best = max(expected_commits(p, np.asarray(ls)).sum()
                   for ls in itertools.product(range(1, BS + 1), repeat=3) if sum(ls) <= budget)
        assert got == pytest.approx(best)


def test_memory_bound_batch_one_is_never_below_fixed_length():
    """Where verifying 16 tokens costs about what 1 does, the choice is never slower than
    fixed-16 verification (nor than AR), and with confident drafts it verifies the whole block."""
    costs = memory_bound()
    for score in (0.1, 0.4, 0.9, 1.0):
        length, rate = choose_uniform([score], 16, costs)
        p = per_token_acceptance(np.asarray([score]) * 16, 16)
        fixed = _rate(p, [16], costs.draft_s(1) + costs.verify_s(1, 16))
        assert rate >= fixed - 1e-12 and rate >= 1 / costs.verify_s(1, 1)
    assert choose_uniform([1.0], 16, costs)[0] == 16


def test_compute_bound_low_acceptance_falls_back_to_ar():
    length, _ = choose_uniform([0.25, 0.25, 0.25, 0.25], BS, compute_bound(draft=1.0))
    assert length == 1

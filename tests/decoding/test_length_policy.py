"""The engine's verify plan picks the argmax of expected committed tokens per second
(checked against brute force over every length assignment)."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.decoding.length_policy import verify_lengths
from adaflash_jax.decoding.verify_plan import (StepCosts, allocate, best_allocation, drafting_pays,
                                               expected_commits, per_token_acceptance)

BS = 4


def acceptance(scores, block_size=BS):
    return per_token_acceptance(jnp.asarray(scores, jnp.float32), block_size)


def commits(p, lengths) -> float:
    return float(np.sum(expected_commits(jnp.asarray(p), jnp.asarray(lengths, jnp.float32))))


def compute_bound(buckets, draft=0.3, batch=3):
    """Verify cost grows with the packed tokens (a compute-bound target), plus a fixed overhead."""
    verify = [0.2 + 0.25 * n for n in buckets]
    return StepCosts(jnp.asarray(verify, jnp.float32), jnp.float32(draft), jnp.float32(0.2 + 0.25 * batch))


def test_acceptance_model_inverts_expected_commits():
    scores = np.asarray([1.0, 1.5, 3.0, 7.9, 16.0]) / 16
    p = acceptance(scores, 16)
    np.testing.assert_allclose(expected_commits(p, 16), scores * 16, rtol=1e-4)
    assert float(p[0]) == pytest.approx(0.0, abs=1e-6) and float(p[-1]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("scores", [[0.3, 0.9, 0.6], [1.0, 0.25, 1.0], [0.25, 0.25, 0.3], [0.5, 0.95, 0.8]])
def test_best_allocation_is_the_brute_force_argmax(scores):
    buckets = (4, 6, 8, 12)
    costs = compute_bound(buckets)
    p = acceptance(scores)
    live = jnp.ones((3,), bool)
    lengths, k, rate = best_allocation(p, live, buckets, BS, costs)
    best = max(commits(p, ls) / (0.3 + float(costs.verify_s[i]))
               for i, bucket in enumerate(buckets)
               for ls in itertools.product(range(1, BS + 1), repeat=3) if sum(ls) <= bucket)
    assert float(rate) == pytest.approx(best, rel=1e-5)
    assert sum(np.asarray(lengths)) <= buckets[int(k)] and all(1 <= x <= BS for x in np.asarray(lengths))


def test_greedy_allocation_is_optimal_for_its_budget():
    p = acceptance([0.3, 0.9, 0.6])
    for budget in range(3, 3 * BS + 1):
        got = commits(p, allocate(p, jnp.ones((3,), bool), budget, BS))
        best = max(commits(p, ls) for ls in itertools.product(range(1, BS + 1), repeat=3) if sum(ls) <= budget)
        assert got == pytest.approx(best, rel=1e-6)


def test_finished_rows_verify_nothing_and_live_rows_stay_optimal():
    rng = np.random.default_rng(0)
    live = np.array([True, False, True, True])
    for _ in range(4):
        p = jnp.asarray(rng.uniform(0.05, 0.95, size=4), jnp.float32)
        for budget in (3, 5, 8, 12):
            got = np.asarray(allocate(p, jnp.asarray(live), budget, BS))
            assert got[1] == 0 and all(1 <= got[i] <= BS for i in (0, 2, 3)) and got.sum() <= max(budget, 3)
            best = max(commits(p[live], ls) for ls in itertools.product(range(1, BS + 1), repeat=3)
                       if sum(ls) <= budget)
            assert commits(p[live], got[live]) == pytest.approx(best, rel=1e-6)


def test_memory_bound_confident_drafts_verify_the_whole_block():
    """Where verifying 16 tokens costs about what 1 does, confident drafts fill the block."""
    buckets = (2, 4, 8, 16)
    costs = StepCosts(jnp.asarray([1.0 + 0.001 * n for n in buckets], jnp.float32), jnp.float32(0.1),
                      jnp.float32(1.0))
    p, live = acceptance([1.0], 16), jnp.ones((1,), bool)
    lengths, k, _ = best_allocation(p, live, buckets, 16, costs)
    assert int(k) == len(buckets) - 1 and int(lengths[0]) == 16
    assert bool(drafting_pays(p, live, buckets, 16, costs))


def test_compute_bound_low_acceptance_falls_back_to_ar():
    buckets = (4, 8, 16)
    costs = compute_bound(buckets, draft=1.0, batch=4)
    assert not bool(drafting_pays(acceptance([0.25] * 4), jnp.ones((4,), bool), buckets, BS, costs))


class _Head:
    """Stands in for a length head's weights: any weak-referenceable object."""


def test_probe_memory_is_per_head_and_forgets_collected_heads():
    import gc

    from adaflash_jax.decoding.length_policy import ProbeMemory, probe_setting

    memory = ProbeMemory()
    costs = StepCosts(jnp.asarray([1.0, 2.0]), jnp.float32(0.5), jnp.float32(1.0))
    setting = probe_setting(BS, 4, costs, 8)
    assert setting == (BS, 4, (1.0, 2.0, 0.5, 1.0), 8)
    head, other = _Head(), _Head()
    memory.put(head, setting, "state-a")
    assert memory.get(head, setting) == "state-a"
    assert memory.get(head, probe_setting(BS, 8, costs, 8)) is None  # another batch
    assert memory.get(other, setting) is None  # another head
    del head
    gc.collect()
    assert len(memory) == 0  # the entry left with its head
    assert memory.get(_Head(), setting) is None  # even an object given the dead head's id


def test_decode_stats_import_numpy_only():
    """The serving runtime's statistics module must not pull in jax (or the engine)."""
    import subprocess
    import sys

    probe = ("import sys, adaflash_jax.decoding.decode_stats as s; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_verify_length_rule():

    scores = jnp.asarray([0.0, 0.04, 0.25, 0.5, 0.77, 1.0])
    got = np.asarray(verify_lengths(scores, 16, rho=1.3, min_len=2)).tolist()
    want = [int(np.clip(np.round(s * 16 * 1.3), 2, 16)) for s in np.asarray(scores)]
    assert got == want and got[0] == 2 and got[-1] == 16
    with pytest.raises(ValueError, match="min_len"):
        verify_lengths(scores, 16, min_len=0)
    with pytest.raises(ValueError, match="rho"):
        verify_lengths(scores, 16, rho=0.0)
    with pytest.raises(ValueError, match="rho must be positive, got nan"):
        verify_lengths(scores, 16, rho=float("nan"))

"""Rollout store: complete shards only, resume without loss or duplicates."""

import json
import os

import numpy as np
import pytest

import adaflash_jax as af
from adaflash_jax.models.config import ModelConfig
from adaflash_jax.training import rollouts

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, eos_token_ids=(3,))


@pytest.fixture(scope="module")
def target():
    return af.random_target(CFG, seed=2)


def _prompts(n):
    rng = np.random.default_rng(0)
    return [rng.integers(4, 64, size=int(rng.integers(2, 9))).tolist() for _ in range(n)]


def test_rollouts_match_generation_and_resume(tmp_path, target, monkeypatch):
    prompts, domains = _prompts(10), ["code", "math"] * 5
    out = str(tmp_path / "r")
    calls = {"n": 0}
    real = rollouts._write_shard

    def dying(*args, **kwargs):  # killed while the third shard completes
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(rollouts, "_write_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        rollouts.generate_rollouts(target, prompts, domains, out, max_new_tokens=12, batch_size=4,
                                   progress=False)
    assert rollouts.completed_shards(out) == [0, 1]
    monkeypatch.setattr(rollouts, "_write_shard", real)
    stats = rollouts.generate_rollouts(target, prompts, domains, out, max_new_tokens=12,
                                       batch_size=4, progress=False)
    assert stats["shards_skipped"] == 2 and stats["shards_total"] == 3
    records = list(rollouts.read_rollouts(out))
    assert [r["index"] for r in records] == list(range(10))
    expected = af.generate(target, prompts, max_new_tokens=12).token_ids
    assert [r["response_ids"] for r in records] == expected
    assert [r["prompt_ids"] for r in records] == prompts
    assert [r["domain"] for r in records] == domains


def test_mismatched_settings_refused(tmp_path, target):
    out = str(tmp_path / "r")
    rollouts.generate_rollouts(target, _prompts(4), ["x"] * 4, out, max_new_tokens=8,
                               batch_size=4, progress=False)
    with pytest.raises(ValueError, match="different settings"):
        rollouts.generate_rollouts(target, _prompts(4), ["x"] * 4, out, max_new_tokens=9,
                                   batch_size=4, progress=False)
    assert rollouts.completed_shards(out) == [0]


def test_a_store_of_another_target_is_refused_and_an_older_one_gains_the_fingerprint(tmp_path, target):
    out = str(tmp_path / "r")
    rollouts.generate_rollouts(target, _prompts(4), ["x"] * 4, out, max_new_tokens=8, batch_size=4, progress=False)
    path = os.path.join(out, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    assert manifest["target_fingerprint"] == target.fingerprint()
    other = af.random_target(CFG, seed=3)  # same shapes and name, other weights
    with pytest.raises(ValueError, match="another target"):
        rollouts.generate_rollouts(other, _prompts(8), ["x"] * 8, out, max_new_tokens=8, batch_size=4,
                                   progress=False)
    assert rollouts.completed_shards(out) == [0]
    # a store written before manifests recorded the fingerprint takes this target's on its next run
    del manifest["target_fingerprint"]
    with open(path, "w") as f:
        json.dump(manifest, f)
    rollouts.generate_rollouts(target, _prompts(4), ["x"] * 4, out, max_new_tokens=8, batch_size=4, progress=False)
    with open(path) as f:
        assert json.load(f) == {**manifest, "target_fingerprint": target.fingerprint()}


def test_store_extends_with_more_prompts_of_the_same_order(tmp_path, target):
    out, prompts = str(tmp_path / "r"), _prompts(12)
    rollouts.generate_rollouts(target, prompts[:8], ["x"] * 8, out, max_new_tokens=8, batch_size=4,
                               progress=False)
    stats = rollouts.generate_rollouts(target, prompts, ["x"] * 12, out, max_new_tokens=8, batch_size=4,
                                       progress=False)
    assert stats["shards_skipped"] == 2 and rollouts.completed_shards(out) == [0, 1, 2]
    assert [r["prompt_ids"] for r in rollouts.read_rollouts(out)] == prompts
    # another prompt order is refused before anything is decoded or written
    with pytest.raises(ValueError, match="other prompts"):
        rollouts.generate_rollouts(target, prompts[::-1] + _prompts(16)[12:], ["x"] * 16, out,
                                   max_new_tokens=8, batch_size=4, progress=False)
    assert rollouts.completed_shards(out) == [0, 1, 2]


def test_sampled_responses_beside_the_greedy_one(tmp_path, target):
    out, prompts = str(tmp_path / "r"), _prompts(4)
    rollouts.generate_rollouts(target, prompts, ["x"] * 4, out, max_new_tokens=8, batch_size=4,
                               samples=2, temperature=1.0, progress=False)
    records = list(rollouts.read_rollouts(out))
    assert [r["sample"] for r in records] == [0] * 4 + [1] * 4 + [2] * 4
    greedy = af.generate(target, prompts, max_new_tokens=8).token_ids
    assert [r["response_ids"] for r in records[:4]] == greedy
    sampled = [r["response_ids"] for r in records[4:]]
    assert sampled != greedy * 2  # T = 1 on a random target: the samples differ from greedy
    again = str(tmp_path / "again")  # seeded: a rewritten store is identical
    rollouts.generate_rollouts(target, prompts, ["x"] * 4, again, max_new_tokens=8, batch_size=4,
                               samples=2, temperature=1.0, progress=False)
    assert [r["response_ids"] for r in rollouts.read_rollouts(again)] == [r["response_ids"] for r in records]
    per_shard = tmp_path / "per_shard"  # continuous batching writes what per-shard batches write
    per_shard.mkdir()
    rollouts.write_rollout_shard(target, prompts, ["x"] * 4, str(per_shard), 0, max_new_tokens=8, batch_size=4,
                                 samples=2, temperature=1.0)
    assert list(rollouts.read_rollouts(str(per_shard))) == records


def test_a_sampled_only_store_holds_the_samples_a_full_store_holds(tmp_path, target):
    prompts = _prompts(8)
    full, sampled = str(tmp_path / "full"), str(tmp_path / "sampled")
    rollouts.generate_rollouts(target, prompts, ["x"] * 8, full, max_new_tokens=8, batch_size=4,
                               samples=1, temperature=1.0, progress=False)
    rollouts.generate_rollouts(target, prompts, ["x"] * 8, sampled, max_new_tokens=8, batch_size=4,
                               samples=1, temperature=1.0, greedy=False, progress=False, shards=(0, 1))
    rollouts.generate_rollouts(target, prompts, ["x"] * 8, sampled, max_new_tokens=8, batch_size=4,
                               samples=1, temperature=1.0, greedy=False, progress=False)  # resumes at shard 1
    assert list(rollouts.read_rollouts(sampled)) == [r for r in rollouts.read_rollouts(full) if r["sample"] == 1]
    with open(os.path.join(sampled, "manifest.json")) as f:
        assert json.load(f)["greedy"] is False
    with pytest.raises(ValueError, match="different settings"):  # a greedy job refuses the sampled store
        rollouts.generate_rollouts(target, prompts, ["x"] * 8, sampled, max_new_tokens=8, batch_size=4,
                                   samples=1, temperature=1.0, progress=False)
    with pytest.raises(ValueError, match="needs samples"):
        rollouts.generate_rollouts(target, prompts, ["x"] * 8, str(tmp_path / "none"), greedy=False)
    both = rollouts.rollout_arrays(f"{full},{sampled}", seq_len=32)  # several stores: records in order
    assert len(both["tokens"]) == 16 + 8
    with pytest.raises(ValueError, match="no rollout shards"):
        rollouts.rollout_arrays(f"{full},{tmp_path / 'absent'}", seq_len=32)


def test_rollout_arrays(tmp_path, target):
    out = str(tmp_path / "r")
    prompts = _prompts(6)
    rollouts.generate_rollouts(target, prompts, ["d"] * 6, out, max_new_tokens=10, batch_size=3,
                               progress=False)
    arrays = rollouts.rollout_arrays(out, seq_len=16)
    recs = list(rollouts.read_rollouts(out))
    for i, rec in enumerate(recs):
        seq = (rec["prompt_ids"] + rec["response_ids"])[:16]
        assert arrays["tokens"][i, :len(seq)].tolist() == seq
        assert arrays["seq_lens"][i] == len(seq) and arrays["prompt_lens"][i] == len(rec["prompt_ids"])


def test_a_shard_range_writes_only_its_shards_and_the_rest_fills_in(tmp_path, target):
    prompts, domains = _prompts(12), ["x"] * 12
    out, whole = str(tmp_path / "r"), str(tmp_path / "whole")
    stats = rollouts.generate_rollouts(target, prompts, domains, out, max_new_tokens=8, batch_size=4,
                                       progress=False, shards=(1, 2))
    assert rollouts.completed_shards(out) == [1]
    assert stats["shards_selected"] == 1 and stats["shards_skipped"] == 0
    first = rollouts.read_shard(out, 1)
    assert [r["index"] for r in first] == [4, 5, 6, 7]
    stats = rollouts.generate_rollouts(target, prompts, domains, out, max_new_tokens=8, batch_size=4,
                                       progress=False)  # the whole job: shard 1 is kept as it is
    assert rollouts.completed_shards(out) == [0, 1, 2] and stats["shards_skipped"] == 1
    assert rollouts.read_shard(out, 1) == first
    rollouts.generate_rollouts(target, prompts, domains, whole, max_new_tokens=8, batch_size=4, progress=False)
    assert list(rollouts.read_rollouts(out)) == list(rollouts.read_rollouts(whole))
    for bad in [(3, 5), (2, 2), (-1, 2)]:
        with pytest.raises(ValueError, match="select none"):
            rollouts.generate_rollouts(target, prompts, domains, out, max_new_tokens=8, batch_size=4,
                                       progress=False, shards=bad)

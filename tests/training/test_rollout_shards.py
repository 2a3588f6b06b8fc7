"""Compact rollout shards: what is written is read back record for record, at about two
bytes a token, and stores holding older ArrayRecord shards keep working and can be compacted."""

import json
import os

import numpy as np
import pytest

from adaflash_jax.training import rollouts
from adaflash_jax.training.rollout_shards import read_npz_shard, write_npz_shard


def records(n, seed, vocab=49152, first=0):
    rng = np.random.default_rng(seed)
    return [{"index": first + i, "prompt_ids": rng.integers(0, vocab, int(rng.integers(5, 40))).tolist(),
             "sample": i % 2, "response_ids": rng.integers(0, vocab, int(rng.integers(0, 200))).tolist(),
             "domain": ("code", "math", "prose")[i % 3]} for i in range(n)]


def write_legacy(path, recs):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, "group_size:1")
    for rec in recs:
        writer.write(json.dumps(rec).encode())
    writer.close()


def test_a_shard_round_trips_at_about_two_bytes_a_token(tmp_path):
    recs = records(32, seed=0)
    rollouts._write_shard(rollouts._shard_path(str(tmp_path), 3), recs)
    assert os.listdir(tmp_path) == ["rollouts-00003.npz"]
    assert rollouts.read_shard(str(tmp_path), 3) == recs
    tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in recs)
    assert os.path.getsize(tmp_path / "rollouts-00003.npz") < 2.5 * tokens + 2000  # random ids barely compress


def test_ids_past_uint16_and_empty_responses(tmp_path):
    recs = records(4, seed=1, vocab=200_000)
    recs[0]["response_ids"] = []
    write_npz_shard(str(tmp_path / "s.npz"), recs)
    assert read_npz_shard(str(tmp_path / "s.npz")) == recs


def test_a_store_mixing_both_forms_reads_in_order_and_compacts(tmp_path):
    old, new = records(8, seed=2), records(8, seed=3, first=8)
    write_legacy(str(tmp_path / "rollouts-00000.array_record"), old)
    rollouts._write_shard(rollouts._shard_path(str(tmp_path), 1), new)
    assert rollouts.completed_shards(str(tmp_path)) == [0, 1]
    assert list(rollouts.read_rollouts(str(tmp_path))) == old + new
    assert rollouts.compact_store(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == ["rollouts-00000.npz", "rollouts-00001.npz"]
    assert list(rollouts.read_rollouts(str(tmp_path))) == old + new
    assert rollouts.compact_store(str(tmp_path)) == 0


def test_rewriting_an_older_shard_replaces_it(tmp_path):
    write_legacy(str(tmp_path / "rollouts-00002.array_record"), records(4, seed=4))
    fresh = records(4, seed=5)
    rollouts._write_shard(rollouts._shard_path(str(tmp_path), 2), fresh)
    assert os.listdir(tmp_path) == ["rollouts-00002.npz"] and rollouts.read_shard(str(tmp_path), 2) == fresh


def test_negative_ids_are_refused(tmp_path):
    bad = records(1, seed=6)
    bad[0]["prompt_ids"] = [-1, 2]
    with pytest.raises(ValueError, match="token ids"):
        write_npz_shard(str(tmp_path / "s.npz"), bad)

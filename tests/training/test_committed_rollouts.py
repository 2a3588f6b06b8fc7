"""The rollout stores committed in `data/rollouts/`: the greedy one and the two T = 0.7 ones
(sampled responses only, prompt seeds 0 and 1) each load by their manifest as the trainer reads them, fit the
shipped target, and share no prompt with the fixed evaluation set (compared by a hash of
the chat-templated token ids); the held-out store holds exactly that set's prompts, and the
retraining config reads the training stores."""

import hashlib
import json
import os

import numpy as np
import pytest

from adaflash_jax.eval.heldout import EVAL_DOMAINS, heldout_prompts
from adaflash_jax.training.config import load_config
from adaflash_jax.training.rollouts import completed_shards, read_rollouts

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "data", "rollouts")
STORES = ("smollm2-135m-instruct", "smollm2-135m-instruct-t0.7", "smollm2-135m-instruct-t0.7-s1")
EVAL_STORE = "smollm2-135m-instruct-eval"


def digest(ids) -> str:
    return hashlib.sha256(np.asarray(ids, np.uint32).tobytes()).hexdigest()


@pytest.fixture(scope="module", params=STORES)
def store(request):
    return os.path.join(ROOT, request.param)


@pytest.fixture(scope="module")
def records(store):
    return list(read_rollouts(store))


@pytest.fixture(scope="module")
def eval_digests(smollm2) -> set:
    """The hashes of the fixed evaluation set's 32 prompts per domain."""
    held_out = {digest(case.ids) for cases in heldout_prompts(smollm2, 32).values() for case in cases}
    assert len(held_out) == 32 * len(EVAL_DOMAINS)  # the hash tells every eval prompt apart
    return held_out


def manifest_of(store) -> dict:
    with open(os.path.join(store, "manifest.json")) as f:
        return json.load(f)


def rows_by_manifest(store) -> int:
    """The rows a store's completed shards hold by its manifest: every shard is full but the
    pool's last, which holds what is left of the pool."""
    manifest = manifest_of(store)
    samples_per_prompt = manifest["samples"] + int(manifest.get("greedy", True))
    size, pool = manifest["shard_size"], manifest["num_prompts"]
    return samples_per_prompt * sum(min(size, pool - k * size) for k in completed_shards(store))


def test_the_store_loads_by_its_manifest_and_fits_the_target(store, records, smollm2):
    manifest = manifest_of(store)
    assert manifest["target"] == smollm2.name and manifest["vocab_size"] == smollm2.cfg.vocab_size
    assert manifest["target_fingerprint"] == smollm2.fingerprint()
    assert completed_shards(store) and len(records) == rows_by_manifest(store)
    assert all(1 <= len(r["response_ids"]) <= manifest["max_new_tokens"] for r in records)
    assert max(max(r["prompt_ids"] + r["response_ids"]) for r in records) < smollm2.cfg.vocab_size
    assert {r["domain"] for r in records} <= set(EVAL_DOMAINS)


def test_no_store_prompt_is_in_the_fixed_evaluation_set(records, smollm2, eval_digests):
    stored = {digest(r["prompt_ids"]) for r in records}
    assert stored and not stored & eval_digests
    # both sides carry the same chat template, so equal prompts would hash equal
    first_eval = heldout_prompts(smollm2, 1)[EVAL_DOMAINS[0]][0].ids
    assert len(os.path.commonprefix([records[0]["prompt_ids"], first_eval])) >= 3


def test_the_held_out_store_holds_the_fixed_evaluation_set_greedy(smollm2, eval_digests):
    store = os.path.join(ROOT, EVAL_STORE)
    manifest = manifest_of(store)
    assert manifest["target_fingerprint"] == smollm2.fingerprint() and manifest["greedy"] and not manifest["samples"]
    records = list(read_rollouts(store))
    assert {digest(r["prompt_ids"]) for r in records} == eval_digests
    assert len(records) == 32 * len(EVAL_DOMAINS)


def test_the_retraining_config_reads_the_committed_stores():
    data = load_config("smollm2_135m_retrain").data
    assert data.path.split(",") == [f"data/rollouts/{name}" for name in STORES]
    assert data.eval_path == f"data/rollouts/{EVAL_STORE}"
    # the rows it pins are all committed (each store's count by manifest is checked against
    # what it reads in `test_the_store_loads_by_its_manifest_and_fits_the_target`)
    assert 0 < data.max_rows <= sum(rows_by_manifest(os.path.join(ROOT, name)) for name in STORES)

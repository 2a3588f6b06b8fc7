"""The grain prompt pipeline: batch layout, filtering, seeded shuffling, sharding and resumption."""

import itertools
import json
import pickle

import numpy as np
import pytest

from adaflash_jax.data import TRAINABLE_DOMAINS, ConcatenatedSource, load_prompts, make_prompt_iterator
from adaflash_jax.data.pipeline import TokenizeChatPrompt

BATCH, MAX_LEN = 8, 512


@pytest.fixture(scope="module")
def train_source(small_build):
    return ConcatenatedSource([load_prompts(domain, "train", small_build[0]) for domain in TRAINABLE_DOMAINS])


def batches(source, tokenizer, **overrides):
    options = dict(batch_size=BATCH, max_prompt_len=MAX_LEN, seed=0, num_epochs=1, shard_index=0, shard_count=1)
    options.update(overrides)
    return make_prompt_iterator(source, tokenizer, **options)


def chat_ids(tokenizer, prompt):
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text)


def indices_of(iterator):
    return [batch["example_index"].tolist() for batch in iterator]


def test_batches_are_fixed_shape_right_padded_chat_prompts(train_source, tokenizer):
    iterator = batches(train_source, tokenizer, pad_id=0)
    all_batches = list(iterator)
    assert iterator.dropped_too_long == 0 and iterator.dropped_empty == 0
    assert len(all_batches) == len(train_source) // BATCH
    domain_of = {name: i for i, name in enumerate(("code", "math", "prose", "humaneval"))}
    for batch in all_batches[:3]:
        assert batch["tokens"].shape == (BATCH, MAX_LEN) and batch["tokens"].dtype == np.int32
        assert batch["lengths"].dtype == np.int32 and batch["domain_ids"].dtype == np.int32
        for row, index in enumerate(batch["example_index"]):
            record = train_source[int(index)]
            expected = chat_ids(tokenizer, record["prompt"].decode())
            length = batch["lengths"][row]
            assert length == len(expected) and batch["tokens"][row, :length].tolist() == expected
            assert not batch["tokens"][row, length:].any()
            assert batch["domain_ids"][row] == domain_of[record["domain"].decode()]


def test_over_long_and_empty_prompts_are_dropped_and_counted(tokenizer):
    source = [{"prompt": "Say hi.", "domain": "math"}, {"prompt": "  ", "domain": "math"},
              {"prompt": "word " * 300, "domain": "math"}] + [{"prompt": f"Add {i} and {i}.", "domain": "math"}
                                                            for i in range(5)]
    limit = max(len(chat_ids(tokenizer, record["prompt"])) for record in source[3:]) + 1
    iterator = batches(source, tokenizer, batch_size=2, max_prompt_len=limit)
    kept = [index for batch in indices_of(iterator) for index in batch]
    assert sorted(kept) == [0, 3, 4, 5, 6, 7][: len(kept)] and len(kept) == 6
    assert (iterator.dropped_too_long, iterator.dropped_empty) == (1, 1)
    with pytest.raises(ValueError, match="fits max_prompt_len"):
        next(batches(source[2:3], tokenizer, batch_size=1, max_prompt_len=limit, num_epochs=None))


def test_shuffle_is_a_function_of_the_seed(train_source, tokenizer):
    assert indices_of(batches(train_source, tokenizer, seed=3)) == indices_of(batches(train_source, tokenizer, seed=3))
    assert indices_of(batches(train_source, tokenizer, seed=3)) != indices_of(batches(train_source, tokenizer, seed=4))


def test_each_epoch_is_a_new_permutation_of_the_same_records(train_source, tokenizer):
    per_epoch = len(train_source) // BATCH
    two_epochs = indices_of(batches(train_source, tokenizer, num_epochs=2))
    first, second = two_epochs[:per_epoch], two_epochs[per_epoch:]
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(len(train_source)))


def test_process_shards_partition_the_records(train_source, tokenizer):
    shards = [sum(indices_of(batches(train_source, tokenizer, shard_index=i, shard_count=2)), []) for i in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(len(train_source)))
    defaults = make_prompt_iterator(train_source, tokenizer, batch_size=BATCH, max_prompt_len=MAX_LEN, seed=0,
                                    num_epochs=1)  # one JAX process: the only shard is everything
    assert indices_of(defaults) == indices_of(batches(train_source, tokenizer))
    with pytest.raises(ValueError, match="shard_index"):
        batches(train_source, tokenizer, shard_index=2, shard_count=2)


@pytest.mark.parametrize("num_epochs", [1, None])
def test_restored_iterator_yields_exactly_the_remaining_batches(train_source, tokenizer, num_epochs):
    # A tight max_prompt_len drops some prose, so the drop counts must survive the restore too.
    options = dict(num_epochs=num_epochs, max_prompt_len=160)
    total = None if num_epochs else 2 * len(train_source) // BATCH + 3  # forever: cross epoch boundaries
    uninterrupted_iterator = batches(train_source, tokenizer, **options)
    uninterrupted = list(itertools.islice(uninterrupted_iterator, total))
    consumed = 5
    interrupted = batches(train_source, tokenizer, **options)
    for _ in range(consumed):
        next(interrupted)
    state = json.loads(json.dumps(interrupted.get_state()))  # as a checkpoint would store it
    resumed = batches(train_source, tokenizer, **options)
    resumed.set_state(state)
    rest = list(itertools.islice(resumed, None if total is None else total - consumed))
    assert len(rest) == len(uninterrupted) - consumed
    for got, want in zip(rest, uninterrupted[consumed:]):
        assert all(np.array_equal(got[key], want[key]) for key in want)
    assert uninterrupted_iterator.dropped_too_long > 0
    assert resumed.dropped_too_long == uninterrupted_iterator.dropped_too_long


def test_unknown_domains_are_reported(tokenizer):
    with pytest.raises(ValueError, match="poetry"):
        next(batches([{"prompt": "Write a poem.", "domain": "poetry"}], tokenizer, batch_size=1))
    assert next(batches([{"prompt": "Write a poem.", "domain": "poetry"}], tokenizer, batch_size=1,
                        domains=("poetry",)))["domain_ids"].tolist() == [0]


def test_transforms_pickle_for_worker_processes(train_source, tokenizer):
    transform = TokenizeChatPrompt(train_source, tokenizer, {"code": 0, "math": 1, "prose": 2})
    restored = pickle.loads(pickle.dumps(transform))
    assert restored(0)["tokens"].tolist() == transform(0)["tokens"].tolist()


@pytest.mark.slow
def test_worker_processes_give_the_same_resumable_stream(train_source, tokenizer):
    reference = indices_of(batches(train_source, tokenizer))
    with_workers = batches(train_source, tokenizer, worker_count=2)
    head = [next(with_workers)["example_index"].tolist() for _ in range(3)]
    state = with_workers.get_state()
    resumed = batches(train_source, tokenizer, worker_count=2)
    resumed.set_state(state)
    assert head + indices_of(resumed) == reference

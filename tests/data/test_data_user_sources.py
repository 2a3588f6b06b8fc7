"""Mapping a user dataset's column to prompts, end to end through TFDS and the pipeline."""

import pickle

import pytest
from local_builder import QUESTIONS, LocalQuestions

from adaflash_jax.data import make_prompt_iterator, prompt_records, prompt_source
from adaflash_jax.data.user_sources import tfds_dataset_name


@pytest.fixture(scope="module")
def local_data_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("local_questions")
    LocalQuestions(data_dir=data_dir).download_and_prepare()
    return data_dir


def question_with_topic(row):
    return f"[{row['topic'].decode()}] {row['question'].decode()}"


def test_a_column_of_a_tfds_dataset_becomes_prompts(local_data_dir):
    source = prompt_source("local_questions", column="question", split="train", data_dir=local_data_dir)
    assert len(source) == len(QUESTIONS["train"])
    assert source[0] == {"prompt": QUESTIONS["train"][0][0], "domain": "local_questions",
                         "source": "local_questions:train:0"}
    assert [source[i]["prompt"] for i in range(len(source))] == [q for q, _, _ in QUESTIONS["train"]]
    assert pickle.loads(pickle.dumps(source))[1] == source[1]


def test_a_function_of_the_row_and_a_chosen_domain(local_data_dir):
    source = prompt_source("local_questions", column=question_with_topic, split="test", domain="prose",
                           data_dir=local_data_dir)
    assert source[1] == {"prompt": "[arithmetic] What is 7 plus 15?", "domain": "prose",
                         "source": "local_questions:test:1"}


def test_a_misspelt_column_lists_the_available_ones(local_data_dir):
    source = prompt_source("local_questions", column="questions", data_dir=local_data_dir)
    with pytest.raises(KeyError, match="answer.*question.*topic"):
        source[0]


def test_rows_in_memory_map_the_same_way():
    rows = [{"text": "Translate 'cat' to French.", "id": 1}, {"text": b"Name a prime number.", "id": 2}]
    assert list(prompt_records(rows, column="text", domain="misc", source="mine")) == [
        {"prompt": "Translate 'cat' to French.", "domain": "misc", "source": "mine:0"},
        {"prompt": "Name a prime number.", "domain": "misc", "source": "mine:1"},
    ]
    with pytest.raises(TypeError, match="must be text"):
        list(prompt_records(rows, column="id", domain="misc", source="mine"))


def test_hugging_face_names_use_the_tfds_spelling():
    assert tfds_dataset_name("huggingface:openai/gsm8k", "main") == "huggingface:openai__gsm8k/main"
    assert tfds_dataset_name("squad") == "squad"
    assert tfds_dataset_name("glue", "mrpc") == "glue/mrpc"


def test_user_prompts_feed_the_pipeline(local_data_dir, tokenizer):
    source = prompt_source("local_questions", column="question", data_dir=local_data_dir)
    iterator = make_prompt_iterator(source, tokenizer, batch_size=4, max_prompt_len=64, seed=0, num_epochs=1,
                                    shard_index=0, shard_count=1, domains=("local_questions",))
    batches = list(iterator)
    assert len(batches) == 2 and all(batch["domain_ids"].tolist() == [0] * 4 for batch in batches)
    assert sorted(i for batch in batches for i in batch["example_index"].tolist()) == list(range(8))

"""grain pipeline: prompt records -> chat template -> token ids -> fixed-shape batches.

Order of operations, and why:

1. Shard record indices by JAX process (`index::count`), so hosts read disjoint records
   and together cover every record once per epoch.
2. Shuffle the shard with the seed; repeating reshuffles each epoch (grain derives the
   epoch's permutation from seed + epoch), so order is a pure function of the arguments.
3. Read + tokenize: the prompt is the user turn of the model's chat template, rendered
   with the generation prompt, exactly as the serving path would see it.
4. Drop, and count, empty prompts and prompts longer than `max_prompt_len`. Over-long
   prompts are dropped rather than truncated: cutting the start loses the system and
   user headers, cutting the end loses the assistant header, and either way the target
   would be conditioned on a prompt no user sends. The counts tell you when
   `max_prompt_len` is too small.
5. Batch to `[batch_size, max_prompt_len]` int32 right-padded tokens plus lengths,
   domain ids and record indices; the last partial batch is dropped, so every batch has
   the same static shape (one jit compilation).

The iterator is a grain `DatasetIterator`: `get_state()` after k batches and
`set_state()` on a freshly made iterator continue with batch k+1 exactly. Every
transform is a top-level class, so the pipeline pickles into grain worker processes.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import grain
from absl import flags
import jax
import numpy as np

from .records import PROMPT_DOMAINS


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class ConcatenatedSource:
    """Several random-access sources read as one (e.g. the train splits of all domains)."""

    def __init__(self, sources: Sequence[Any]):
        self.sources = list(sources)
        self._ends = np.cumsum([len(source) for source in self.sources]).tolist()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} records")
        which = bisect.bisect_right(self._ends, index)
        start = self._ends[which - 1] if which else 0
        return self.sources[which][index - start]


@dataclasses.dataclass(frozen=True)
class TokenizeChatPrompt:
    """Record index -> `{tokens, domain_id, example_index}`; empty prompts give no tokens."""

    source: Any
    tokenizer: Any
    domain_ids: Mapping[str, int]

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        record = self.source[int(index)]
        prompt, domain = _text(record["prompt"]), _text(record["domain"])
        if domain not in self.domain_ids:
            raise ValueError(f"record {index} has domain {domain!r}, not one of {sorted(self.domain_ids)}; "
                             "pass it in `domains=`")
        tokens: list[int] = []
        if prompt.strip():
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True)
            tokens = self.tokenizer.encode(text)
        return {"tokens": np.asarray(tokens, np.int32), "domain_id": np.int32(self.domain_ids[domain]),
                "example_index": np.int64(index)}


def pad_prompt_batch(examples: Sequence[Mapping[str, np.ndarray]], max_prompt_len: int, pad_id: int):
    """Stack tokenized prompts into right-padded `[B, max_prompt_len]` arrays."""
    tokens = np.full((len(examples), max_prompt_len), pad_id, np.int32)
    for row, example in enumerate(examples):
        tokens[row, : len(example["tokens"])] = example["tokens"]
    return {
        "tokens": tokens,
        "lengths": np.asarray([len(example["tokens"]) for example in examples], np.int32),
        "domain_ids": np.asarray([example["domain_id"] for example in examples], np.int32),
        "example_index": np.asarray([example["example_index"] for example in examples], np.int64),
    }


class PromptBatchIterator(grain.DatasetIterator):
    """Skips prompts that cannot be used, counts them, and emits fixed-shape batches."""

    def __init__(self, parent: grain.DatasetIterator, *, batch_size: int, max_prompt_len: int, pad_id: int,
                 records_per_pass: int):
        super().__init__(parent)
        self._batch_size, self._max_prompt_len, self._pad_id = batch_size, max_prompt_len, pad_id
        self._records_per_pass = records_per_pass
        self.dropped_too_long = 0
        self.dropped_empty = 0

    def __next__(self) -> dict[str, np.ndarray]:
        examples, dropped_in_a_row = [], 0
        while len(examples) < self._batch_size:
            example = next(self._parent)  # StopIteration here drops the partial last batch
            length = len(example["tokens"])
            if 0 < length <= self._max_prompt_len:
                examples.append(example)
                dropped_in_a_row = 0
                continue
            if length == 0:
                self.dropped_empty += 1
            else:
                self.dropped_too_long += 1
            dropped_in_a_row += 1
            # Two passes' worth: after an epoch boundary the next usable prompt may be ~2N records away.
            if dropped_in_a_row >= 2 * self._records_per_pass:
                raise ValueError(f"no prompt in this shard is non-empty and fits max_prompt_len="
                                 f"{self._max_prompt_len} ({self.dropped_too_long} too long, "
                                 f"{self.dropped_empty} empty)")
        return pad_prompt_batch(examples, self._max_prompt_len, self._pad_id)

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "dropped_too_long": self.dropped_too_long,
                "dropped_empty": self.dropped_empty}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self.dropped_too_long = int(state["dropped_too_long"])
        self.dropped_empty = int(state["dropped_empty"])


class PromptBatches(grain.IterDataset):
    """The batching stage as a grain dataset, so it composes like any other."""

    def __init__(self, parent: grain.IterDataset, *, batch_size: int, max_prompt_len: int, pad_id: int,
                 records_per_pass: int):
        super().__init__(parent)
        self._options = dict(batch_size=batch_size, max_prompt_len=max_prompt_len, pad_id=pad_id,
                             records_per_pass=records_per_pass)

    def __iter__(self) -> PromptBatchIterator:
        return PromptBatchIterator(self._parent.__iter__(), **self._options)


def _use_default_absl_flags_if_unparsed() -> None:
    """grain's worker start-up reads absl flags and raises unless they were parsed (as
    `absl.app.run` does); outside an absl app, accept the defaults."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def make_prompt_dataset(
    source: Any,
    tokenizer: Any,
    *,
    batch_size: int,
    max_prompt_len: int,
    seed: int,
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    domains: Sequence[str] = PROMPT_DOMAINS,
    pad_id: int = 0,
    read_threads: int = 2,
    worker_count: int = 0,
) -> PromptBatches:
    """The pipeline as a grain `IterDataset`; see `make_prompt_iterator` for the arguments."""
    shard_index = jax.process_index() if shard_index is None else int(shard_index)
    shard_count = jax.process_count() if shard_count is None else int(shard_count)
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
    if batch_size < 1 or max_prompt_len < 1:
        raise ValueError(f"batch_size and max_prompt_len must be positive, got {batch_size}, {max_prompt_len}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be a positive integer or None (forever), got {num_epochs}")
    indices = grain.MapDataset.range(len(source))[shard_index::shard_count]
    if len(indices) == 0:
        raise ValueError(f"shard {shard_index} of {shard_count} is empty: the source has {len(source)} records")
    records_per_pass = len(indices)
    tokenized = (
        indices.shuffle(seed=seed)
        .repeat(num_epochs)
        .map(TokenizeChatPrompt(source, tokenizer, {name: i for i, name in enumerate(domains)}))
        .to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * batch_size))
    )
    if worker_count > 0:
        _use_default_absl_flags_if_unparsed()
        tokenized = tokenized.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return PromptBatches(tokenized, batch_size=batch_size, max_prompt_len=max_prompt_len, pad_id=pad_id,
                         records_per_pass=records_per_pass)


def make_prompt_iterator(
    source: Any,
    tokenizer: Any,
    *,
    batch_size: int,
    max_prompt_len: int,
    seed: int,
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    domains: Sequence[str] = PROMPT_DOMAINS,
    pad_id: int = 0,
    read_threads: int = 2,
    worker_count: int = 0,
) -> PromptBatchIterator:
    """Resumable iterator of prompt batches for this process's shard.

    `source`: any random-access source of `{prompt, domain, ...}` records (a TFDS data
    source from `load_prompts`, a `ColumnPromptSource`, a list of dicts); wrap several
    in `ConcatenatedSource([...])` to read them as one.
    `num_epochs=None` repeats forever. `shard_index`/`shard_count` default to
    `jax.process_index()`/`jax.process_count()`. `domains` fixes the id of each domain
    name (its position). `worker_count > 0` tokenizes in grain worker processes.
    Batches: `tokens` int32 [B, max_prompt_len] right-padded with `pad_id`, `lengths`
    int32 [B], `domain_ids` int32 [B], `example_index` int64 [B] (index into `source`).
    The iterator's `dropped_too_long` / `dropped_empty` count skipped prompts.
    """
    return iter(make_prompt_dataset(
        source, tokenizer, batch_size=batch_size, max_prompt_len=max_prompt_len, seed=seed,
        num_epochs=num_epochs, shard_index=shard_index, shard_count=shard_count, domains=domains,
        pad_id=pad_id, read_threads=read_threads, worker_count=worker_count,
    ))

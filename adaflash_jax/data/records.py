"""Prompt records, version-stable randomness, and the train/eval split rule shared by all domains.

Every domain produces a stream of `(group_key, PromptRecord)` pairs, where the group is
the unit a near-duplicate can hide in (a stdlib module, a man page, a help section, one
math problem). `assign_splits` puts each whole group into exactly one split, so no
eval prompt has a sibling in train.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

# Domains with a train split; HumanEval is only ever evaluated on.
TRAINABLE_DOMAINS = ("code", "math", "prose")
EVAL_ONLY_DOMAINS = ("humaneval",)
PROMPT_DOMAINS = TRAINABLE_DOMAINS + EVAL_ONLY_DOMAINS


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt plus where it came from (`source` names the module, page or template)."""

    prompt: str
    domain: str
    source: str

    def as_example(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def stable_hash(*parts: object) -> int:
    """64-bit hash that, unlike `hash()`, is the same in every process and Python version."""
    text = "\x1f".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def stable_order(items: Iterable[T], seed: int, key=str) -> list[T]:
    """The items in a seeded pseudo-random order that depends only on their keys."""
    return sorted(items, key=lambda item: (stable_hash(seed, key(item)), key(item)))


def stable_choice(options: Sequence[T], *parts: object) -> T:
    """Pick one option as a pure function of `parts` (e.g. the template for one item)."""
    return options[stable_hash(*parts) % len(options)]


class StableRandom:
    """Seeded draws built only on `random.Random.random()`.

    Python guarantees `random()` reproduces across versions for an integer seed, but not
    `randint`/`choice`, whose algorithms have changed; the math problems rely on this.
    """

    def __init__(self, seed: int):
        self._rng = random.Random(seed)

    def randint(self, low: int, high: int) -> int:
        """Uniform integer in [low, high], both inclusive."""
        return low + min(int(self._rng.random() * (high - low + 1)), high - low)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.randint(0, len(options) - 1)]

    def sample(self, options: Sequence[T], count: int) -> list[T]:
        pool = list(options)
        return [pool.pop(self.randint(0, len(pool) - 1)) for _ in range(count)]


def normalized_text(text: str) -> str:
    """Lower-cased, whitespace-collapsed text, for spotting duplicates."""
    return re.sub(r"\s+", " ", text).strip().lower()


def round_robin(streams: Sequence[Iterable[T]]) -> Iterator[T]:
    """Interleave streams one item at a time, so no source crowds out the others."""
    iterators = [iter(stream) for stream in streams]
    while iterators:
        alive = []
        for iterator in iterators:
            try:
                yield next(iterator)
            except StopIteration:
                continue
            alive.append(iterator)
        iterators = alive


def assign_splits(
    grouped_records: Iterable[tuple[str, PromptRecord]],
    *,
    eval_size: int,
    train_size: int | None,
    eval_group_cap: int = 4,
) -> dict[str, list[PromptRecord]]:
    """Fill `eval` then `train` from a stream whose order is already seeded.

    A group is assigned when its first record arrives: to eval while eval has room,
    else to train. Later records of an eval group never reach train (they are dropped
    once eval is full or the group has given `eval_group_cap` records, which spreads
    eval over many groups). Exact duplicate prompts are kept once. The stream is read
    only until both splits are full, so lazy sources stay cheap for small builds.
    """
    splits: dict[str, list[PromptRecord]] = {"train": [], "eval": []}
    group_split: dict[str, str] = {}
    eval_group_counts: dict[str, int] = {}
    seen_prompts: set[str] = set()

    def train_full() -> bool:
        return train_size is not None and len(splits["train"]) >= train_size

    for group_key, record in grouped_records:
        if len(splits["eval"]) >= eval_size and train_full():
            break
        prompt_key = normalized_text(record.prompt)
        if not prompt_key or prompt_key in seen_prompts:
            continue
        split = group_split.setdefault(group_key, "eval" if len(splits["eval"]) < eval_size else "train")
        if split == "eval":
            if len(splits["eval"]) >= eval_size or eval_group_counts.get(group_key, 0) >= eval_group_cap:
                continue
            eval_group_counts[group_key] = eval_group_counts.get(group_key, 0) + 1
        elif train_full():
            continue
        seen_prompts.add(prompt_key)
        splits[split].append(record)
    return splits

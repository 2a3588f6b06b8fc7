"""Prompt data: offline TFDS prompt sets, user datasets, and the grain batching pipeline.

`build_prompt_datasets` / `load_prompts` (prompts.py) give the built-in domains;
`prompt_source` / `prompt_records` (user_sources.py) map any dataset's column to prompts;
`make_prompt_iterator` (pipeline.py) turns either into resumable, sharded token batches.
"""

from .pipeline import ConcatenatedSource, make_prompt_dataset, make_prompt_iterator
from .prompts import (
    AdaflashHumaneval,
    AdaflashPrompts,
    build_prompt_datasets,
    dataset_name,
    is_eval_only,
    load_prompts,
)
from .records import EVAL_ONLY_DOMAINS, PROMPT_DOMAINS, TRAINABLE_DOMAINS, PromptRecord
from .user_sources import ColumnPromptSource, prompt_records, prompt_source

__all__ = [
    "AdaflashHumaneval", "AdaflashPrompts", "ColumnPromptSource", "ConcatenatedSource", "EVAL_ONLY_DOMAINS",
    "PROMPT_DOMAINS", "PromptRecord", "TRAINABLE_DOMAINS", "build_prompt_datasets", "dataset_name",
    "is_eval_only", "load_prompts", "make_prompt_dataset", "make_prompt_iterator", "prompt_records",
    "prompt_source",
]

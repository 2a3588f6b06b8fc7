"""Natural text for pre-training a drafter: cheap data beyond target rollouts.

A rollout costs one target decode step per token; natural text costs one
target prefill per token for its features, an order of magnitude less on a
CPU. The text itself is the label (EAGLE trained on fixed responses the same
way), so this is a pre-training stage: fine-tune on the target's own
rollouts after it.

Sources are what every Debian-like machine carries (`text_sources`): Python
standard-library sources (code) and man pages, Info manuals, Vim help and
stdlib module docs (prose). Every document the fixed evaluation set was built
from is left out (its man page, help file, Info node or Python module), so
pre-training never reads the text an evaluation prompt quotes.

The output is the trainer's `data.source="arrays"` format: an .npz of padded
token windows `tokens` [N, seq_len], `prompt_lens` (a short context before the
first anchor) and `seq_lens`, with the documents' ids alongside in a JSON file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np

from adaflash_jax.atomic_io import atomic_write_json, temp_path_beside
from adaflash_jax.data.code_prompts import stdlib_module_files
from adaflash_jax.data.eval_set import load_eval_set
from adaflash_jax.data.prose_prompts import ProseSourceDirs, available_prose_streams
from adaflash_jax.data.records import round_robin, stable_order


def eval_documents() -> tuple[set[str], set[str]]:
    """(passage sources, top-level Python modules) the fixed evaluation set was built from."""
    sources, modules = set(), set()
    for prompts in load_eval_set().values():
        for p in prompts:
            if p.source.startswith(("man:", "vim:", "info:")):
                sources.add(p.source)
            elif p.source.startswith("python:"):
                modules.add(p.source[len("python:"):].split(".")[0])
            elif not p.source.startswith(("math:", "HumanEval/")):
                modules.add(p.source.split(".")[0])  # a code prompt names its stdlib API
    return sources, modules


def code_documents(seed: int, excluded_modules: set[str], root: str | None = None) -> Iterator[tuple[str, str]]:
    """(`code:<module>`, source text) of standard-library modules, in seeded order."""
    for module, path in stable_order(stdlib_module_files(root), seed, key=lambda item: item[0]):
        if module.split(".")[0] in excluded_modules or module.startswith("encodings."):
            continue  # (the codecs are generated character tables, not code)
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f"code:{module}", f.read()


def prose_documents(seed: int, excluded_sources: set[str], excluded_modules: set[str],
                    dirs: ProseSourceDirs | None = None) -> Iterator[tuple[str, str]]:
    """(source, its passages joined by blank lines) of each prose document, interleaved across
    the available sources (a document's passages arrive together from its reader)."""
    def documents(stream):
        current, paragraphs = None, []
        for _, passage in stream:
            if passage.source != current and paragraphs:
                yield current, "\n\n".join(paragraphs)
                paragraphs = []
            current = passage.source
            if passage.source in excluded_sources or (
                    passage.source.startswith("python:") and
                    passage.source[len("python:"):].split(".")[0] in excluded_modules):
                continue
            paragraphs.append(passage.text)
        if paragraphs:
            yield current, "\n\n".join(paragraphs)

    streams = available_prose_streams(dirs or ProseSourceDirs(), seed)
    yield from round_robin([documents(s) for s in streams.values()])


def token_windows(ids: Sequence[int], seq_len: int, min_len: int) -> list[list[int]]:
    """Consecutive windows of at most seq_len tokens; a last window shorter than min_len is dropped."""
    return [list(ids[i:i + seq_len]) for i in range(0, len(ids), seq_len) if len(ids) - i >= min_len]


def build_text_corpus(tokenizer, out_path: str, *, rows: int, seq_len: int = 384, context: int = 16,
                      code_fraction: float = 0.5, seed: int = 0, progress: bool = True,
                      stdlib_root: str | None = None, prose_dirs: ProseSourceDirs | None = None) -> dict:
    """Writes `rows` token windows (code_fraction of them from code) to out_path (.npz, atomic)
    and <out_path>.json (settings, counts, the documents used and those left out). Returns the
    settings and counts."""
    if rows < 1 or seq_len <= context + 2 or not 0.0 <= code_fraction <= 1.0:
        raise ValueError(f"need rows >= 1, seq_len > context + 2 and code_fraction in [0, 1]; got rows={rows}, "
                         f"seq_len={seq_len}, context={context}, code_fraction={code_fraction}")
    sources, modules = eval_documents()
    want = {"code": int(round(rows * code_fraction))}
    want["prose"] = rows - want["code"]
    streams = {"code": code_documents(seed, modules, stdlib_root),
               "prose": prose_documents(seed, sources, modules, prose_dirs)}
    tokens = np.zeros((rows, seq_len), np.int32)
    lens = np.zeros((rows,), np.int32)
    docs: dict[str, list[str]] = {"code": [], "prose": []}
    n, counts = 0, {}
    bar = _progress(rows, progress)
    for kind, stream in streams.items():
        got = counts[kind] = 0
        for doc_id, text in stream:
            if got >= want[kind]:
                break
            windows = token_windows(tokenizer.encode(text), seq_len, context + 2 + 32)
            if windows:
                docs[kind].append(doc_id)
            for w in windows[:want[kind] - got]:
                tokens[n, :len(w)], lens[n] = w, len(w)
                n, got = n + 1, got + 1
                bar.update(1)
        counts[kind] = got
    bar.close()
    if n == 0:
        raise FileNotFoundError("no natural text found: no Python stdlib sources, man pages, Info manuals "
                                "or Vim help on this machine")
    stats = {"rows": n, "requested_rows": rows, "seq_len": seq_len, "context": context, "seed": seed,
             "tokens": int(lens[:n].sum()), "rows_per_kind": counts,
             "documents": docs, "excluded_eval_sources": sorted(sources), "excluded_modules": sorted(modules)}
    tmp = temp_path_beside(out_path)
    with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a bare name
        np.savez(f, tokens=tokens[:n], prompt_lens=np.full((n,), context, np.int32), seq_lens=lens[:n])
    os.replace(tmp, out_path)
    atomic_write_json(out_path + ".json", stats)
    return {k: v for k, v in stats.items() if k not in ("documents", "excluded_eval_sources", "excluded_modules")}


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="text windows", unit="row", disable=not enabled)

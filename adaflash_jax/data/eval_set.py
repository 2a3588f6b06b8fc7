"""The fixed evaluation set: held-out prompts frozen once into a package asset.

The built-in prompt sets are generated from whatever the machine has installed, so
their eval splits differ between machines and may coincide with another machine's
training prompts. The asset (`adaflash_jax/assets/eval/`, written by
`benchmarks/freeze_eval_set.py`) pins the evaluation text everywhere, and training
excludes it by the sha256 of each prompt's UTF-8 text (`is_eval_prompt`).

    by_domain = load_eval_set(("math",))   # {"math": [EvalPrompt(domain, prompt, source, sha256), ...]}
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple

EVAL_SET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "eval")
EVAL_SET_FILE = "eval_set.jsonl"
MANIFEST_FILE = "eval_set.json"
EVAL_SET_DOMAINS = ("code", "math", "prose", "humaneval")
EVAL_SET_VERSION = 1
_FIELDS = ("domain", "prompt", "source", "sha256")


class EvalPrompt(NamedTuple):
    domain: str
    prompt: str  # the user message, before any chat template
    source: str  # where the prompt came from (stdlib name, man page, HumanEval task id, ...)
    sha256: str  # hex digest of `prompt` as UTF-8


class EvalSetError(ValueError):
    """The evaluation-set asset is missing, corrupt or inconsistent with its manifest."""


def prompt_hash(text: str) -> str:
    """sha256 hex digest of a prompt's UTF-8 text: the identity training excludes by."""
    if not isinstance(text, str):
        raise TypeError(f"prompt_hash takes the prompt text (str), got {type(text).__name__}")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _file_hash(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def write_eval_set(prompts: Iterable[EvalPrompt], directory: str = EVAL_SET_DIR, **manifest_extra) -> dict:
    """Writes the asset (records + manifest) to `directory`; returns the manifest.

    Records keep the given order; hashes are recomputed from the text so a written set
    always validates. `manifest_extra` records how the set was built.
    """
    records = [EvalPrompt(p.domain, p.prompt, p.source, prompt_hash(p.prompt)) for p in prompts]
    _check_records(records, "the records to write")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, EVAL_SET_FILE)
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for record in records:
            handle.write(json.dumps(record._asdict(), ensure_ascii=False, sort_keys=True) + "\n")
    counts = {d: sum(r.domain == d for r in records) for d in EVAL_SET_DOMAINS}
    manifest = {"version": EVAL_SET_VERSION, "file": EVAL_SET_FILE, "file_sha256": _file_hash(path),
                "counts": {d: n for d, n in counts.items() if n}, **manifest_extra}
    with open(os.path.join(directory, MANIFEST_FILE), "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, sort_keys=True)
        handle.write("\n")
    return manifest


def _check_records(records: Sequence[EvalPrompt], where: str) -> None:
    seen = {}
    for i, r in enumerate(records):
        if r.domain not in EVAL_SET_DOMAINS:
            raise EvalSetError(f"{where}: record {i} has unknown domain {r.domain!r}; known: {EVAL_SET_DOMAINS}")
        if not r.prompt.strip():
            raise EvalSetError(f"{where}: record {i} ({r.domain}) has an empty prompt")
        if r.sha256 != prompt_hash(r.prompt):
            raise EvalSetError(f"{where}: record {i} ({r.domain}, {r.source}) fails its sha256: the prompt "
                               "text was changed; regenerate with benchmarks/freeze_eval_set.py")
        if r.sha256 in seen:
            raise EvalSetError(f"{where}: records {seen[r.sha256]} and {i} hold the same prompt")
        seen[r.sha256] = i


def _parse_line(line: str, lineno: int, path: str) -> EvalPrompt:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise EvalSetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict) or set(raw) != set(_FIELDS):
        keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise EvalSetError(f"{path}:{lineno}: expected an object with keys {list(_FIELDS)}, got {keys}")
    if not all(isinstance(raw[k], str) for k in _FIELDS):
        raise EvalSetError(f"{path}:{lineno}: every field must be a string")
    return EvalPrompt(**{k: raw[k] for k in _FIELDS})


def _stamp(path: str):
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def _read_eval_set(directory: str) -> tuple[EvalPrompt, ...]:
    """The validated records, re-read whenever either file changes on disk."""
    directory = os.path.abspath(directory)
    return _read_validated(directory, _stamp(os.path.join(directory, MANIFEST_FILE)),
                           _stamp(os.path.join(directory, EVAL_SET_FILE)))


@functools.lru_cache(maxsize=4)
def _read_validated(directory: str, *_stamps) -> tuple[EvalPrompt, ...]:
    manifest_path, path = os.path.join(directory, MANIFEST_FILE), os.path.join(directory, EVAL_SET_FILE)
    for p in (manifest_path, path):
        if not os.path.isfile(p):
            raise EvalSetError(f"evaluation set file missing: {p} (reinstall the package, or regenerate it "
                               "with benchmarks/freeze_eval_set.py)")
    try:
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EvalSetError(f"{manifest_path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("version") != EVAL_SET_VERSION:
        raise EvalSetError(f"{manifest_path}: expected version {EVAL_SET_VERSION}, got "
                           f"{manifest.get('version') if isinstance(manifest, dict) else manifest!r}")
    if _file_hash(path) != manifest.get("file_sha256"):
        raise EvalSetError(f"{path} does not match the sha256 in {MANIFEST_FILE}: the file is corrupt or was "
                           "edited; regenerate with benchmarks/freeze_eval_set.py")
    with open(path, encoding="utf-8") as handle:
        records = [_parse_line(line, n, path) for n, line in enumerate(handle, 1) if line.strip()]
    _check_records(records, path)
    counts = {d: sum(r.domain == d for r in records) for d in EVAL_SET_DOMAINS}
    if {d: n for d, n in counts.items() if n} != manifest.get("counts"):
        raise EvalSetError(f"{path}: per-domain counts {counts} disagree with the manifest's {manifest.get('counts')}")
    return tuple(records)


def load_eval_set(domains: Sequence[str] = EVAL_SET_DOMAINS, *,
                  directory: str = EVAL_SET_DIR) -> dict[str, list[EvalPrompt]]:
    """{domain: prompts in stored order} of the fixed set, validated (see `EvalSetError`)."""
    if isinstance(domains, str):
        raise ValueError(f"domains must be a sequence of names, not the string {domains!r}")
    unknown = [d for d in domains if d not in EVAL_SET_DOMAINS]
    if unknown:
        raise ValueError(f"unknown evaluation domains {unknown}; the fixed set has {EVAL_SET_DOMAINS}")
    records = _read_eval_set(directory)
    return {d: [r for r in records if r.domain == d] for d in domains}


def eval_prompt_hashes(directory: str = EVAL_SET_DIR) -> frozenset[str]:
    """sha256 hex digests of every prompt in the fixed set (all domains)."""
    return frozenset(r.sha256 for r in _read_eval_set(directory))


def is_eval_prompt(text: str, hashes: frozenset[str] | None = None) -> bool:
    """Whether `text` is in the fixed set (or in `hashes`): such prompts are never trained on."""
    return prompt_hash(text) in (eval_prompt_hashes() if hashes is None else hashes)

"""The fixed evaluation set: the shipped asset validates, corrupt copies are refused, and
training prompt selection never returns one of its prompts."""

import hashlib
import json
import os
import shutil
from types import SimpleNamespace

import pytest

from adaflash_jax.data import load_prompts
from adaflash_jax.data.eval_set import (
    EVAL_SET_DIR,
    EVAL_SET_DOMAINS,
    EVAL_SET_FILE,
    MANIFEST_FILE,
    EvalPrompt,
    EvalSetError,
    eval_prompt_hashes,
    load_eval_set,
    prompt_hash,
    write_eval_set,
)
from adaflash_jax.eval.heldout import MAX_PROMPT_TOKENS, heldout_prompts
from adaflash_jax.training.rollout_job import interleaved_prompts

TRAIN_DOMAINS = ("code", "math", "prose")


def test_shipped_asset_loads_with_valid_unique_hashes():
    sets = load_eval_set()
    assert tuple(sets) == EVAL_SET_DOMAINS
    every = [p for prompts in sets.values() for p in prompts]
    for domain, prompts in sets.items():
        assert len(prompts) >= 32
        assert all(p.domain == domain and p.prompt.strip() and p.source for p in prompts)
    assert all(p.sha256 == hashlib.sha256(p.prompt.encode("utf-8")).hexdigest() for p in every)
    assert len({p.sha256 for p in every}) == len(every) == len(eval_prompt_hashes())
    assert eval_prompt_hashes() == {p.sha256 for p in every}
    assert prompt_hash("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert load_eval_set(("math",)) == {"math": sets["math"]}
    with pytest.raises(ValueError, match="unknown evaluation domains"):
        load_eval_set(("poetry",))


def _copy(tmp_path):
    target = tmp_path / "eval"
    shutil.copytree(EVAL_SET_DIR, target)
    return target


def _edit_jsonl(directory, edit, *, fix_manifest):
    path = directory / EVAL_SET_FILE
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[3] = edit(lines[3])
    path.write_text("".join(lines), encoding="utf-8")
    if fix_manifest:  # as if the manifest were regenerated from the edited file
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        manifest["file_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def _reword(line):
    record = json.loads(line)
    record["prompt"] += " (edited)"
    return json.dumps(record) + "\n"


@pytest.mark.parametrize("edit, fix_manifest, needle", [
    (_reword, False, "does not match the sha256 in eval_set.json"),
    (_reword, True, "fails its sha256: the prompt text was changed"),
    (lambda line: line[: len(line) // 2] + "\n", True, "not valid JSON"),
    (lambda line: json.dumps({**json.loads(line), "extra": "x"}) + "\n", True, "expected an object with keys"),
])
def test_corrupt_copies_are_refused(tmp_path, edit, fix_manifest, needle):
    directory = _copy(tmp_path)
    assert load_eval_set(directory=str(directory)) == load_eval_set()  # the intact copy loads
    _edit_jsonl(directory, edit, fix_manifest=fix_manifest)
    with pytest.raises(EvalSetError, match=needle):
        load_eval_set(directory=str(directory))
    with pytest.raises(EvalSetError, match=needle):
        eval_prompt_hashes(str(directory))


def test_missing_files_and_duplicates_are_refused(tmp_path):
    directory = _copy(tmp_path)
    os.remove(directory / MANIFEST_FILE)
    with pytest.raises(EvalSetError, match="evaluation set file missing: .*eval_set.json"):
        load_eval_set(directory=str(directory))
    twice = [EvalPrompt("math", "What is 2 + 2?", "t", "")] * 2
    with pytest.raises(EvalSetError, match="hold the same prompt"):
        write_eval_set(twice, str(tmp_path / "dup"))


def test_heldout_prompts_read_the_fixed_set(tokenizer):
    target = SimpleNamespace(tokenizer=tokenizer, cfg=SimpleNamespace(vocab_size=tokenizer.vocab_size))
    sets = load_eval_set()
    got = heldout_prompts(target, 32)
    for domain in EVAL_SET_DOMAINS:
        assert [c.text for c in got[domain]] == [p.prompt for p in sets[domain][:32]]
        # the set was selected under these limits with this tokenizer's chat template
        assert all(len(c.ids) <= MAX_PROMPT_TOKENS[domain] for c in got[domain])
    shifted = heldout_prompts(target, 2, domains=("prose",), offset=5, data_dir="/ignored")
    assert [c.text for c in shifted["prose"]] == [p.prompt for p in sets["prose"][5:7]]
    with pytest.raises(ValueError, match="fixed evaluation set has 32 code prompts"):
        heldout_prompts(target, 33, domains=("code",))


@pytest.mark.parametrize("domain", TRAIN_DOMAINS)
def test_training_prompts_never_come_from_the_fixed_set(small_build, domain):
    data_dir, _ = small_build
    fixed = eval_prompt_hashes()
    pool = [r["prompt"].decode() for r in load_prompts(domain, "train", data_dir=data_dir)]
    clean = [t for t in pool if prompt_hash(t) not in fixed]
    texts, _ = interleaved_prompts(data_dir, (domain,), per_domain=len(clean), seed=3)
    assert sorted(texts) == sorted(clean)  # everything but the fixed set's prompts, nothing else
    assert not {prompt_hash(t) for t in texts} & fixed
    if len(clean) < len(pool):  # the small build's train split overlaps this machine's eval split
        with pytest.raises(ValueError, match=rf"\({len(pool) - len(clean)} skipped as evaluation-set"):
            interleaved_prompts(data_dir, (domain,), per_domain=len(clean) + 1, seed=3)


def test_a_planted_eval_prompt_is_skipped(small_build, tmp_path):
    data_dir = small_build[0]
    everything, labels = interleaved_prompts(data_dir, TRAIN_DOMAINS, per_domain=4, seed=0, exclude=frozenset())
    planted = [everything[0], everything[4]]  # the first code pick, the second math pick
    write_eval_set([EvalPrompt("prose", t, "planted", "") for t in planted], str(tmp_path / "set"))
    texts, got_labels = interleaved_prompts(data_dir, TRAIN_DOMAINS, per_domain=3, seed=0,
                                            exclude=eval_prompt_hashes(str(tmp_path / "set")))
    assert not set(planted) & set(texts)
    for domain in TRAIN_DOMAINS:  # the same seeded order, minus the planted prompts
        kept = [t for t, d in zip(everything, labels) if d == domain and t not in planted]
        assert [t for t, d in zip(texts, got_labels) if d == domain] == kept[:3]

"""The offline prompt sets: splits, counts, determinism, disjointness and the eval-only HumanEval."""

import gzip
import itertools

import pytest

from adaflash_jax.data import (
    AdaflashHumaneval,
    AdaflashPrompts,
    build_prompt_datasets,
    is_eval_only,
    load_prompts,
)
from adaflash_jax.data.code_prompts import stdlib_module_files
from adaflash_jax.data.math_prompts import math_records
from adaflash_jax.data.prompts import prompt_set_builder
from adaflash_jax.data.prose_prompts import ProseSourceDirs, prose_records
from adaflash_jax.data.records import PromptRecord, StableRandom, assign_splits
from adaflash_jax.data.text_sources import man_page_sections


def read_all(data_source):
    return [{key: value.decode("utf-8") for key, value in data_source[i].items()} for i in range(len(data_source))]


def test_small_build_has_the_expected_splits_and_counts(small_build, small_sizes):
    data_dir, counts = small_build
    trainable = {"train": small_sizes["train"], "eval": small_sizes["eval"]}
    assert counts == {"code": trainable, "math": trainable, "prose": trainable, "humaneval": {"eval": 164}}
    for domain, splits in counts.items():
        for split, count in splits.items():
            records = read_all(load_prompts(domain, split, data_dir))
            assert len(records) == count
            assert {record["domain"] for record in records} == {domain}
            assert all(record["prompt"].strip() and record["source"] for record in records)


def test_build_is_deterministic_across_directories(small_build, second_small_build):
    for domain, splits in small_build[1].items():
        for split in splits:
            first = read_all(load_prompts(domain, split, small_build[0]))
            second = read_all(load_prompts(domain, split, second_small_build[0]))
            assert first == second, (domain, split)


def test_train_and_eval_share_no_prompt_and_no_source_document(small_build):
    data_dir = small_build[0]
    for domain in ("code", "math", "prose"):
        train, held_out = (read_all(load_prompts(domain, split, data_dir)) for split in ("train", "eval"))
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}, domain
    modules = sorted((name for name, _ in stdlib_module_files()), key=len, reverse=True)

    def module_of(qualified):
        return next(module for module in modules if qualified.startswith(module + "."))

    code_train, code_eval = (read_all(load_prompts("code", split, data_dir)) for split in ("train", "eval"))
    assert not {module_of(r["source"]) for r in code_train} & {module_of(r["source"]) for r in code_eval}
    # Man pages, Info nodes and stdlib modules are whole split groups, and their `source` names them.
    prose_train, prose_eval = (read_all(load_prompts("prose", split, data_dir)) for split in ("train", "eval"))
    documents = [{r["source"] for r in records if not r["source"].startswith("vim:")}
                 for records in (prose_train, prose_eval)]
    assert documents[1] and not documents[0] & documents[1]


def test_prose_mixes_several_sources(small_build):
    records = read_all(load_prompts("prose", "train", small_build[0]))
    assert len({record["source"].split(":")[0] for record in records}) >= 2


def test_humaneval_is_eval_only(small_build):
    data_dir = small_build[0]
    assert AdaflashHumaneval.EVAL_ONLY and is_eval_only("humaneval") and not is_eval_only("code")
    assert set(prompt_set_builder("humaneval", data_dir).info.splits) == {"eval"}
    with pytest.raises(ValueError, match="eval-only"):
        load_prompts("humaneval", "train", data_dir)
    records = read_all(load_prompts("humaneval", "eval", data_dir))
    assert [r["source"] for r in records[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert "def has_close_elements" in records[0]["prompt"]


def test_unknown_domain_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt domain"):
        build_prompt_datasets(tmp_path, domains=("poetry",))


def test_default_configs_ask_for_thousands_of_training_prompts():
    for config in AdaflashPrompts.BUILDER_CONFIGS:
        assert config.train_size >= 2000 and 64 <= config.eval_size <= 128 and config.seed == 0


def test_assign_splits_keeps_groups_whole_and_fills_eval_exactly():
    stream = [(f"group{g}", PromptRecord(f"prompt {g}-{i}", "x", f"group{g}")) for g in range(30) for i in range(5)]
    stream.append(("group0", PromptRecord("prompt 0-0", "x", "dup")))  # an exact duplicate
    splits = assign_splits(stream, eval_size=10, train_size=40, eval_group_cap=2)
    assert len(splits["eval"]) == 10 and len(splits["train"]) == 40
    eval_groups = {record.source for record in splits["eval"]}
    assert len(eval_groups) == 5 and not eval_groups & {record.source for record in splits["train"]}
    prompts = [record.prompt for split in splits.values() for record in split]
    assert len(prompts) == len(set(prompts))


def test_math_problems_are_reproducible_and_varied():
    first = [record for _, record in itertools.islice(math_records(7), 300)]
    assert first == [record for _, record in itertools.islice(math_records(7), 300)]
    assert first != [record for _, record in itertools.islice(math_records(8), 300)]
    assert len({record.source for record in first}) >= 10
    assert [StableRandom(3).randint(0, 9) for _ in range(5)] == [StableRandom(3).randint(0, 9) for _ in range(5)]


def test_missing_prose_sources_are_skipped_and_none_at_all_is_an_error(tmp_path):
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    (fortunes / "wisdom").write_text(
        "A journey of a thousand miles begins with a single step, or so they say.\n%\n"
        "Measure twice and cut once, because wood is expensive and patience is cheap.\n%\n")
    (fortunes / "wisdom.dat").write_bytes(b"\x00\x01")  # the index file is never read as text
    missing = str(tmp_path / "missing")
    only_fortunes = ProseSourceDirs(man=missing, vim_help=missing, info=missing, fortunes=str(fortunes),
                                    python_stdlib=missing)
    records = [record for _, record in prose_records(0, only_fortunes)]
    assert len(records) == 2 and {record.source for record in records} == {"fortune:wisdom"}
    assert any("single step" in record.prompt for record in records)
    nothing = ProseSourceDirs(man=missing, vim_help=missing, info=missing, fortunes=missing, python_stdlib=missing)
    with pytest.raises(FileNotFoundError, match="no prose source"):
        next(prose_records(0, nothing))


def test_man_pages_are_read_without_roff_markup(tmp_path):
    page = (
        '.\\" comment\n.TH DEMO 1\n.SH NAME\ndemo \\- show a \\fBdemo\\fR page\n.SH DESCRIPTION\n'
        ".B demo\nprints \\(lqhello\\(rq and exits\\&.\n.PP\n.nf\nexample --not-prose\n.fi\n"
        ".BR Second ( 1 )\nparagraph.\n"
    )
    path = tmp_path / "demo.1.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(page)
    with gzip.open(path, "rt") as handle:
        sections = man_page_sections(handle.read())
    assert sections["NAME"] == ["demo - show a demo page"]
    assert sections["DESCRIPTION"] == ["demo prints \u201chello\u201d and exits.", "Second(1) paragraph."]


@pytest.mark.slow
def test_full_build_sizes(tmp_path):
    counts = build_prompt_datasets(tmp_path)
    for domain in ("code", "math", "prose"):
        assert counts[domain]["train"] >= 2000 and counts[domain]["eval"] == 128, counts
    assert counts["humaneval"] == {"eval": 164}

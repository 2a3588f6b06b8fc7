"""The natural-text corpus: windows of real documents, never one the evaluation set quotes."""

import json
import os

import numpy as np
import pytest

from adaflash_jax.data.eval_set import load_eval_set
from adaflash_jax.data.prose_prompts import ProseSourceDirs
from adaflash_jax.data.text_corpus import build_text_corpus, eval_documents, token_windows


def test_eval_documents_cover_every_quoted_document():
    sources, modules = eval_documents()
    for prompts in load_eval_set().values():
        for p in prompts:
            if p.source.startswith(("man:", "vim:", "info:")):
                assert p.source in sources
            elif p.source.startswith("python:"):
                assert p.source.split(":")[1].split(".")[0] in modules
    assert "shlex" in modules  # a code prompt asks to re-implement shlex.join
    assert not any(m.startswith(("math", "HumanEval")) for m in modules)


def test_token_windows_cut_consecutively_and_drop_a_short_tail():
    ids = list(range(25))
    assert token_windows(ids, 10, 5) == [ids[:10], ids[10:20], ids[20:]]
    assert token_windows(ids, 10, 6) == [ids[:10], ids[10:20]]
    assert token_windows(ids[:3], 10, 5) == []


def _fake_machine(tmp_path):
    root = tmp_path / "stdlib"
    root.mkdir()
    for name in ("alpha", "beta", "shlex"):  # shlex: quoted by the evaluation set
        body = "\n".join(f"def {name}_{i}(x):\n    '''Return x plus {i}.'''\n    return x + {i}\n" for i in range(40))
        (root / f"{name}.py").write_text(f'"""The {name} module: small helpers for tests."""\n{body}')
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    (fortunes / "wisdom").write_text("\n%\n".join(
        f"Saying number {i}: a journey of a thousand miles begins with a single step, or so they say."
        for i in range(30)) + "\n%\n")
    missing = str(tmp_path / "missing")
    return str(root), ProseSourceDirs(man=missing, vim_help=missing, info=missing, fortunes=str(fortunes),
                                      python_stdlib=missing)


def test_corpus_holds_windows_of_real_documents_and_leaves_eval_modules_out(tmp_path, tokenizer):
    root, dirs = _fake_machine(tmp_path)
    out = str(tmp_path / "corpus.npz")
    stats = build_text_corpus(tokenizer, out, rows=8, seq_len=64, context=4, code_fraction=0.5,
                              progress=False, stdlib_root=root, prose_dirs=dirs)
    assert stats["rows"] == 8 and stats["rows_per_kind"] == {"code": 4, "prose": 4}
    with np.load(out) as z:
        tokens, prompt_lens, seq_lens = z["tokens"], z["prompt_lens"], z["seq_lens"]
    assert tokens.shape == (8, 64) and np.all(prompt_lens == 4) and np.all((seq_lens > 4) & (seq_lens <= 64))
    assert np.all(tokens[np.arange(64)[None] >= seq_lens[:, None]] == 0)  # padding past each window
    record = json.load(open(out + ".json"))
    assert "code:shlex" not in record["documents"]["code"] and "shlex" in record["excluded_modules"]
    first = record["documents"]["code"][0].split(":")[1]
    with open(os.path.join(root, f"{first}.py")) as f:
        assert tokens[0].tolist() == tokenizer.encode(f.read())[:64]
    assert sorted(os.listdir(tmp_path)) == ["corpus.npz", "corpus.npz.json", "fortunes", "stdlib"]


def test_corpus_rejects_bad_settings_and_a_machine_without_text(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="code_fraction"):
        build_text_corpus(tokenizer, str(tmp_path / "c.npz"), rows=4, code_fraction=2.0)
    missing = str(tmp_path / "missing")
    nothing = ProseSourceDirs(man=missing, vim_help=missing, info=missing, fortunes=missing, python_stdlib=missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no natural text"):
        build_text_corpus(tokenizer, str(tmp_path / "c.npz"), rows=4, progress=False, stdlib_root=str(empty),
                          prose_dirs=nothing)
    assert not os.path.exists(tmp_path / "c.npz")

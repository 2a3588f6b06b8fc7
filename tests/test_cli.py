"""The `adaflash` CLI in-process: help texts, real decodes on SmolLM2, one-line errors.

The target is loaded once for the module and handed to every command through
`cli._load_target`, so the suite pays for one load and a few compiles.
"""

import json

import pytest

import adaflash_jax as af
from adaflash_jax import cli


@pytest.fixture(scope="module")
def smollm2():
    return af.load_target("smollm2-135m-instruct")


@pytest.fixture
def shared_target(monkeypatch, smollm2):
    monkeypatch.setattr(cli, "_load_target", lambda name, dtype: smollm2)


def test_registry_has_the_current_commands():
    assert {"generate", "demo", "train", "rollout"} <= set(cli.SUBCOMMANDS)


@pytest.mark.parametrize("command, expected", [
    ([], ["generate", "demo", "examples:"]),
    (["generate"], ["--prompt", "--prompt-file", "--max-new-tokens", "--temperature", "--top-p",
                    "--seed", "--dtype", "--drafter", "--verify", "--tree-budget", "--compare-ar", "--json",
                    "examples:"]),
    (["demo"], ["code", "math", "prose", "HumanEval", "--max-new-tokens", "--prompts-per-domain",
                "examples:"]),
    (["train"], ["config", "--fresh", "--overwrite", "KEY=VALUE", "examples:"]),
    (["rollout"], ["--per-domain", "--max-new-tokens", "--drafter", "--out", "--shards", "examples:"]),
])
def test_help_exits_zero_with_useful_text(command, expected, capsys):
    assert cli.main(command + ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: adaflash")
    for text in expected:
        assert text in out, text


def test_every_registered_command_has_help(capsys):
    for name in cli.SUBCOMMANDS:
        assert cli.main([name, "--help"]) == 0
        assert "examples:" in capsys.readouterr().out


def test_generate_prints_reply_and_throughput(shared_target, capsys):
    assert cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) >= 2 and lines[0].strip()
    assert "tokens/s" in lines[-1] and "4 tokens" in lines[-1]


def test_generate_json_is_one_parseable_record(shared_target, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n\nName a colour.\n")
    assert cli.main(["generate", "--prompt-file", str(prompts), "--max-new-tokens", "4", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompts"] == ["hi", "Name a colour."]
    assert len(record["replies"]) == 2 and all(isinstance(r, str) for r in record["replies"])
    assert all(1 <= len(ids) <= 4 for ids in record["token_ids"])
    assert record["stats"]["tokens_per_s"] > 0 and record["settings"]["max_new_tokens"] == 4
    assert "speedup" not in record


def test_demo_runs_with_ar_only_when_no_drafter_is_installed(shared_target, monkeypatch, capsys):
    monkeypatch.setattr(cli, "DEFAULT_DRAFTER", "no-such-drafter")
    monkeypatch.setattr(cli, "DEFAULT_ADAFLASH", "no-such-drafter")
    assert cli.main(["demo", "--max-new-tokens", "4", "--prompts-per-domain", "1"]) == 0
    out = capsys.readouterr().out
    assert "autoregressive decoding only" in out and "summary" in out
    for domain in ("code", "math", "prose", "humaneval"):
        assert f"=== {domain} (held-out)" in out
    table = out[out.index("summary"):].splitlines()
    assert [line.split()[0] for line in table[4:-1]] == ["AR"]  # no speculative rows


def test_generate_tree_verification_equals_ar(shared_target, capsys):
    assert cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "6", "--drafter", cli.DEFAULT_DRAFTER,
                     "--verify", "tree", "--tree-budget", "8", "--compare-ar", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["identical"] and record["settings"]["verify"] == "tree"
    assert record["stats"]["verify"] == "tree" and record["stats"]["tree_budget"] == 8


def test_demo_compares_ar_and_the_shipped_drafters(shared_target, capsys):
    assert cli.main(["demo", "--max-new-tokens", "8", "--prompts-per-domain", "1"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("summary"):]
    assert "DFlash smollm2-135m-instruct-dflash" in table
    assert "AdaFlash smollm2-135m-instruct-adaflash" in table
    lines = table.splitlines()
    assert lines[2].split() == ["method", "tokens/s", "tau", "x", "AR", "code", "math", "prose", "humaneval", "=",
                                "AR"]
    assert max(len(line) for line in lines) <= 100
    rows = [line.split() for line in lines[4:-1]]
    assert [r[0] for r in rows] == ["AR", "DFlash", "AdaFlash"]  # the defaults; fixed modes need --all-modes
    assert all(r[-1] == "yes" for r in rows[1:])  # lossless: every output equals AR's


def _assert_one_line_error(capsys, needle: str):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "error" in err and needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "x"], "invalid int"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "hi", "--dtype", "int8"], "invalid choice"),
    (["generate"], "no prompt"),
    (["generate", "--prompt-file", "/nonexistent/prompts.txt"], "no such file"),
    (["generate", "--prompt", "hi", "--compare-ar"], "--drafter"),
    (["generate", "--prompt", "hi", "--verify", "tree"], "--drafter"),
    (["generate", "--prompt", "hi", "--tree-budget", "8"], "--drafter"),
    (["generate", "--prompt", "hi", "--tree-budget", "auto"], "--drafter"),
    (["generate", "--prompt", "hi", "--tree-budget", "many"], "node count or 'auto'"),
    (["generate", "--prompt", "hi", "--verify", "bush"], "invalid choice"),
    (["generate", "--prompt", "   "], "empty"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "2", "--drafter", "/nonexistent/drafter"],
     "drafter"),
    (["bogus"], "invalid choice"),
    (["demo", "--prompts-per-domain", "0"], "prompts-per-domain"),
    (["train", "no_such_config"], "unknown config"),
    (["train", "tiny", "optim.lr=fast"], "optim.lr"),
    (["train", "tiny", "nosection.x=1"], "unknown config key"),
    (["rollout", "tiny"], "random tiny target"),
    (["rollout", "smollm2_135m", "--per-domain", "0"], "--per-domain"),
    (["rollout", "smollm2_135m", "--shards", "5:2"], "START:STOP"),
    (["rollout", "smollm2_135m", "--shards", "7"], "START:STOP"),
    (["corpus", "tiny", "--out", "/tmp/x.npz"], "random tiny target"),
    (["corpus", "smollm2_135m", "--out", "/tmp/x.txt"], ".npz"),
    (["corpus", "smollm2_135m", "--out", "/tmp/x.npz", "--code-fraction", "1.5"], "--code-fraction"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "temperature must be finite"),
    (["generate", "--prompt", "hi", "--top-p", "inf"], "top_p must be finite"),
    (["serve", "/nonexistent/artifact"], "not an exported decoder"),
    (["serve", "--tree-budget", "4"], "need a --drafter"),
    (["serve", "--tree-budget", "some"], "node count or 'auto'"),
    (["serve", "/some/artifact", "--tree-budget", "4"], "not both"),
    (["serve", "/some/artifact", "--verify", "adaptive"], "not both"),
    (["serve", "--verify", "adaptive"], "need a --drafter"),
    (["serve", "--verify", "beam"], "invalid choice"),
    (["serve", "--drafter", "x", "--verify", "adaptive", "--verify-len", "4"], "chooses its own budgets"),
    (["export", "--out", "/tmp/x", "--drafter", "none", "--tree-budget", "4"], "needs --drafter"),
    (["export", "--out", "/tmp/x", "--tree-budget", "0"], "needs --drafter"),
    (["export", "--out", "/tmp/x", "--tree-budget", "129"], "1 to 128"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, shared_target, capsys):
    assert cli.main(argv) == 2
    _assert_one_line_error(capsys, needle)


def test_unknown_model_path_exits_2_before_loading(capsys):
    assert cli.main(["generate", "--model", "/nonexistent/model", "--prompt", "hi"]) == 2
    _assert_one_line_error(capsys, "unknown target")


def test_an_internal_value_error_is_not_reported_as_bad_input(shared_target, monkeypatch, capsys):
    """Only InputError means "bad input" (exit 2, one line); a ValueError from inside the
    library is a bug and must surface with its traceback."""
    from adaflash_jax.errors import InputError

    def broken(*args, **kwargs):
        raise ValueError("operands could not be broadcast together with shapes (3,) (4,)")

    monkeypatch.setattr(af, "generate", broken)
    with pytest.raises(ValueError, match="could not be broadcast") as error:
        cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "2"])
    assert not isinstance(error.value, InputError)
    assert "adaflash: error" not in capsys.readouterr().err


def _tiny_checkpoint(path) -> str:
    """A tiny random llama's weights and config.json (no tokenizer)."""
    from fixtures import params_to_hf_dir, random_params, tiny_config

    cfg = tiny_config(max_position_embeddings=64)
    hf_config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
                 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
                 "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    return params_to_hf_dir(cfg, random_params(cfg, seed=5), path, hf_config)


def _tiny_checkpoint_with_tokenizer(path) -> str:
    """A tiny random llama with a word-level tokenizer and a plain chat template."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from adaflash_jax.checkpoints.tokenizer import Tokenizer

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    backend = BackendTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    Tokenizer(backend, chat_template=template, bos_token="<s>", eos_token="</s>").save_hf_dir(path)
    return _tiny_checkpoint(path)


def test_corpus_of_a_target_without_tokenizer_exits_2(tmp_path, capsys):
    path = _tiny_checkpoint(tmp_path / "bare")
    out = tmp_path / "c.npz"
    assert cli.main(["corpus", "smollm2_135m", f"target.name={path}", "--out", str(out)]) == 2
    _assert_one_line_error(capsys, "has no tokenizer")
    assert not out.exists()


def test_generate_dtype_bfloat16_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """The real loader: `--dtype bfloat16` reaches the weights and the decode."""
    path = _tiny_checkpoint_with_tokenizer(tmp_path / "tiny")
    seen = []
    real_generate = af.generate

    def spy(target, *args, **kwargs):
        seen.append(target)
        return real_generate(target, *args, **kwargs)

    monkeypatch.setattr(af, "generate", spy)
    argv = ["generate", "--model", path, "--dtype", "bfloat16", "--prompt", "w5 w7 w9", "--max-new-tokens", "6",
            "--json"]
    assert cli.main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    (target,) = seen
    assert target.cfg.dtype == "bfloat16" and record["dtype"] == "bfloat16"
    weights = {str(leaf.dtype) for leaf in __import__("jax").tree.leaves(target.state)}
    assert weights == {"bfloat16"}, weights
    ref = real_generate(af.load_target(path, dtype="bfloat16"), ["w5 w7 w9"], max_new_tokens=6)
    assert record["token_ids"] == ref.token_ids and len(ref.token_ids[0]) >= 1

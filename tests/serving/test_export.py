"""The exported decoder: same tokens as in-process decoding, runnable without the model code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import adaflash_jax as af
from adaflash_jax.decoding.export import export_decoder
from spec_helpers import TEST_PROMPTS, distilled_drafter, tiny_target

MAX_NEW = 24


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("exported") / "artifact")
    export_decoder(tiny_target(), out, drafter=distilled_drafter(), platforms=("cpu", "cuda", "tpu"),
                   max_prompt_len=16, max_new_tokens=32)
    return out


@pytest.fixture(scope="module")
def decoder(artifact):
    return af.load_exported(artifact)


def test_manifest_describes_the_artifact(artifact):
    with open(os.path.join(artifact, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["platforms"] == ["cpu", "cuda", "tpu"]
    loops = {"autoregressive_greedy", "autoregressive_sample", "speculative_greedy", "speculative_sample"}
    engine = {"engine_init", "engine_evict"} | {f"engine_{fn}_{mode}" for mode in ("greedy", "sample") for fn in
                                                ("insert", "step", "prefill_chunk", "insert_chunked")}
    assert set(manifest["functions"]) == loops | engine
    assert manifest["format_version"] == 3 and manifest["engine"]["speculative"]
    assert manifest["drafter"]["block_size"] == distilled_drafter().block_size
    assert manifest["max_prompt_len"] == 16 and manifest["max_new_tokens"] == 32
    for entry in manifest["functions"].values():
        assert os.path.getsize(os.path.join(artifact, entry["file"])) > 0


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_exported_greedy_equals_in_process(decoder, batch):
    prompts = TEST_PROMPTS[:batch]
    ref = af.generate(tiny_target(), prompts, max_new_tokens=MAX_NEW, drafter=distilled_drafter(),
                      verify="chain")  # the exported loop's verification
    spec = decoder.generate(prompts, max_new_tokens=MAX_NEW)
    ar = decoder.generate(prompts, max_new_tokens=MAX_NEW, speculative=False)
    assert spec.token_ids == ref.token_ids
    assert ar.token_ids == ref.token_ids
    assert spec.stats["mean_tau"] == pytest.approx(ref.stats["mean_tau"])
    assert spec.stats["mean_tau"] > 1.5  # the distilled drafter is accepted: drafting happened
    assert spec.stats["steps"] < ar.stats["steps"]


def test_exported_sampling_equals_in_process(decoder):
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=7)
    ref = af.generate(tiny_target(), TEST_PROMPTS, drafter=distilled_drafter(), verify="chain", **kwargs)
    assert decoder.generate(TEST_PROMPTS, **kwargs).token_ids == ref.token_ids


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=33), r"max_new_tokens must lie in \[1, 32\]"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
])
def test_bad_options_are_named(decoder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        decoder.generate(TEST_PROMPTS[:1], **kwargs)


def test_bad_prompts_are_named(decoder):
    with pytest.raises(ValueError, match="takes at most 16"):
        decoder.generate([list(range(1, 18))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.generate([[1, 99]])
    with pytest.raises(ValueError, match="no tokenizer"):
        decoder.generate(["hello"])


def test_existing_output_is_never_overwritten(artifact):
    before = sorted(os.listdir(artifact))
    with pytest.raises(FileExistsError, match="not empty"):
        export_decoder(tiny_target(), artifact, max_new_tokens=8)
    assert sorted(os.listdir(artifact)) == before


def test_export_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="platforms must be"):
        export_decoder(tiny_target(), str(tmp_path / "a"), platforms=("rocm",))
    with pytest.raises(ValueError, match="exceeds the target's context"):
        export_decoder(tiny_target(), str(tmp_path / "b"), max_prompt_len=500, max_new_tokens=64)
    with pytest.raises(ValueError, match="modes must be"):
        export_decoder(tiny_target(), str(tmp_path / "c"), modes=("beam",))
    assert not os.path.exists(tmp_path / "a")


def test_load_exported_names_a_missing_artifact(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        af.load_exported(str(tmp_path))


FRESH = """
import json, sys
import adaflash_jax as af
decoder = af.load_exported(sys.argv[1])
result = decoder.generate(json.loads(sys.argv[2]), max_new_tokens=%d)
loaded = sorted(m for m in sys.modules if m.startswith("adaflash_jax.models")
                or m.startswith("adaflash_jax.decoding.speculative") or m.startswith("flax"))
print(json.dumps({"tokens": result.token_ids, "model_modules": loaded}))
""" % MAX_NEW


def test_artifact_runs_in_a_fresh_process_without_model_code(artifact):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", FRESH, artifact, json.dumps(TEST_PROMPTS)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["model_modules"] == []
    ref = af.generate(tiny_target(), TEST_PROMPTS, max_new_tokens=MAX_NEW, drafter=distilled_drafter())
    assert report["tokens"] == ref.token_ids
    assert np.mean([len(t) for t in report["tokens"]]) > 1


@pytest.fixture(scope="module")
def head_decoder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("exported_head") / "nested" / "artifact")
    export_decoder(tiny_target(), out, drafter=drafter_with_head(), max_prompt_len=16, max_new_tokens=32,
                   modes=("greedy",), platforms=("cpu", "cuda", "tpu"))
    return af.load_exported(out)


def drafter_with_head():
    from flax import nnx

    from adaflash_jax.models.length_head import LengthHead

    head = LengthHead(tiny_target().cfg.hidden_size, 8, rngs=nnx.Rngs(0))
    return distilled_drafter().with_length_head(head)


@pytest.mark.parametrize("batch,rho", [(1, 1.3), (3, 0.4), (4, 0.4)])
def test_exported_head_policy_equals_in_process(head_decoder, batch, rho):
    """AdaFlash's length rule with packed verification, exported with a symbolic batch."""
    assert head_decoder.length_policy == "head"
    prompts = TEST_PROMPTS[:batch]
    ref = af.generate(tiny_target(), prompts, max_new_tokens=MAX_NEW, drafter=drafter_with_head(),
                      length_policy="head", rho=rho)
    got = head_decoder.generate(prompts, max_new_tokens=MAX_NEW, rho=rho)
    assert got.token_ids == ref.token_ids
    assert got.stats["mean_tau"] == pytest.approx(ref.stats["mean_tau"])
    assert got.stats["mean_verify_len"] == pytest.approx(ref.stats["mean_verify_len"])
    with pytest.raises(ValueError, match="min_len must lie"):
        head_decoder.generate(prompts, min_len=99)


def test_overwrite_replaces_only_an_artifact(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="no exported decoder"):
        export_decoder(tiny_target(), str(tmp_path), max_new_tokens=8, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_cli_export_checks_options_before_loading_a_model(tmp_path, capsys):
    from adaflash_jax import cli

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert cli.main(["export", "--out", str(tmp_path / "taken")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert cli.main(["export", "--out", str(tmp_path / "new"), "--platforms", "cpu,rocm"]) == 2
    assert "platforms must be" in capsys.readouterr().err

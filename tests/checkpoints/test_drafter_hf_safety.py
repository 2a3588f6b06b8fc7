"""Drafter checkpoints: configs as the published code writes them, atomic saves, NaN weights."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import adaflash_jax as af
import spec_helpers as H
from adaflash_jax.checkpoints import drafter_hf
from adaflash_jax.errors import InputError
from adaflash_jax.models.drafter import default_target_layer_ids

IDS = np.asarray([H.TEST_PROMPTS[1] + [15, 4, 15]], np.int32)


@pytest.fixture(scope="module")
def target():
    return H.tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return af.init_drafter(target, num_layers=3, block_size=8, seed=3)


def published_config(drafter) -> dict:
    """config.json keys as the published DFlash training code writes them: layer ids left to
    the rule (num_target_layers + num_hidden_layers), only the mask token under dflash_config."""
    c = drafter.cfg
    return {"architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "attention_bias": False,
            "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
            "torch_dtype": "float32", "block_size": c.block_size, "num_target_layers": c.num_target_layers,
            "dflash_config": {"mask_token_id": c.mask_token_id}}


def test_config_without_layer_ids_uses_the_published_rule(target, drafter, tmp_path):
    af.save_drafter(drafter, str(tmp_path / "d"))
    with open(tmp_path / "d" / "config.json", "w") as f:
        json.dump(published_config(drafter), f)
    loaded = af.load_drafter(str(tmp_path / "d"), target=target)
    assert loaded.cfg.target_layer_ids == default_target_layer_ids(H.TINY.num_layers, 3) == (1, 2, 3)
    np.testing.assert_array_equal(af.draft_logits(target, loaded, IDS), af.draft_logits(target, drafter, IDS))


def test_config_without_mask_token_or_layers_is_refused():
    with pytest.raises(InputError, match="not a DFlash drafter"):
        drafter_hf.config_from_hf({"hidden_size": 32, "num_hidden_layers": 2, "num_target_layers": 6})
    with pytest.raises(InputError, match="not a DFlash drafter"):
        drafter_hf.config_from_hf({"num_hidden_layers": 2, "dflash_config": {"mask_token_id": 3}})


def test_save_replaces_a_drafter_and_leaves_no_temporaries(drafter, tmp_path):
    path = tmp_path / "d"
    af.save_drafter(drafter, str(path))
    (path / "stale.txt").write_text("from the old save")
    af.save_drafter(drafter, str(path), dtype="bfloat16")
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["d"]
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_failed_save_keeps_the_previous_drafter(drafter, tmp_path, monkeypatch):
    path = tmp_path / "d"
    af.save_drafter(drafter, str(path))
    before = (path / "model.safetensors").read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.flax.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        af.save_drafter(drafter, str(path), dtype="bfloat16")
    assert (path / "model.safetensors").read_bytes() == before
    assert os.listdir(tmp_path) == ["d"]


def test_save_refuses_a_directory_that_is_not_a_drafter(drafter, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="refusing to replace"):
        af.save_drafter(drafter, str(tmp_path / "run"))
    assert (tmp_path / "run" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_drafter_weights_are_named_at_load(target, drafter, tmp_path, bad):
    af.save_drafter(drafter, str(tmp_path / "d"))
    file = str(tmp_path / "d" / "model.safetensors")
    tensors = load_file(file)
    tensors["layers.1.mlp.up_proj.weight"][0, 3] = bad
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"NaN/Inf.*layers\.1\.mlp\.up_proj\.weight \(1 of"):
        af.load_drafter(str(tmp_path / "d"), target=target)

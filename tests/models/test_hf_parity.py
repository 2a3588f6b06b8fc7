"""fp32 logits parity with HF transformers on tiny random Llama / Qwen3 checkpoints.

Each case is saved with `save_pretrained` (safetensors) and loaded through the public
`af.load_target(dir)`, so config parsing, the name table and the forward are all covered.
"""

import json
import os

import numpy as np
import pytest

import adaflash_jax as af
from fixtures import hf_logits, hf_tiny_model, save_hf

pytest.importorskip("torch")

TOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    "llama-bias-untied": ("llama", dict(attention_bias=True, tie_word_embeddings=False)),
    "llama-tied-llama3-rope": ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE,
                                             max_position_embeddings=256)),
    "qwen3-tied": ("qwen3", dict(num_hidden_layers=3, tie_word_embeddings=True)),
    "qwen3-untied-bias": ("qwen3", dict(tie_word_embeddings=False, attention_bias=True,
                                        rope_theta=1e6)),
}


def token_batch(vocab, batch=2, length=40, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, length))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    model = hf_tiny_model(family, seed=len(request.param), **overrides)
    path = save_hf(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, path


def test_logits_match_transformers(case):
    name, model, path = case
    target = af.load_target(path)
    length = 96 if "llama3" in name else 40
    ids = token_batch(model.config.vocab_size, length=length)
    expected = hf_logits(model, ids)
    got = target.score(ids)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.abs(expected).max() > 1.0  # logits large enough for the tolerance to mean something
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL, err_msg=name)



def test_feature_layers_match_transformers_hidden_states(case):
    """The drafter's features are the requested layers' outputs, in request order (HF's
    hidden_states[i + 1]; its last entry is final-normed, so the last layer is left out)."""
    import torch

    name, model, path = case
    target = af.load_target(path)
    ids = token_batch(model.config.vocab_size)
    layer_ids = list(range(model.config.num_hidden_layers - 1))[::-1]  # out of order on purpose
    with torch.no_grad():
        states = model(torch.as_tensor(ids), output_hidden_states=True).hidden_states
    expected = np.concatenate([states[i + 1].float().numpy() for i in layer_ids], axis=-1)
    got = np.asarray(target.model(np.asarray(ids, np.int32), feature_layers=layer_ids).features)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL, err_msg=name)

def test_config_flags_read_from_checkpoint(case):
    name, model, path = case
    cfg = af.load_target(path).cfg
    hf_cfg = model.config
    assert cfg.tie_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.attention_bias == hf_cfg.attention_bias
    assert cfg.qk_norm == (hf_cfg.model_type == "qwen3")
    assert cfg.num_layers == hf_cfg.num_hidden_layers
    assert (cfg.rope_scaling is not None) == ("llama3" in name)
    assert cfg.eos_token_ids == (2,)


def test_rope_scaling_case_is_sensitive_to_scaling(tmp_path):
    """Dropping the llama3 scaling must break parity; otherwise that case tests nothing."""
    family, overrides = CASES["llama-tied-llama3-rope"]
    model = hf_tiny_model(family, seed=3, **overrides)
    path = save_hf(model, tmp_path / "ckpt")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config.pop("rope_scaling", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    ids = token_batch(model.config.vocab_size, length=96)
    unscaled = af.load_target(path)
    assert unscaled.cfg.rope_scaling is None
    assert np.abs(unscaled.score(ids) - hf_logits(model, ids)).max() > 100 * TOL


def test_legacy_rope_scaling_spelling(tmp_path):
    """Older config.json files spell the scaling `rope_scaling` with `type`, theta at top level."""
    family, overrides = CASES["llama-tied-llama3-rope"]
    model = hf_tiny_model(family, seed=3, **overrides)
    path = save_hf(model, tmp_path / "ckpt")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    scaling = dict(config.pop("rope_parameters"))
    config["rope_theta"] = scaling.pop("rope_theta")
    scaling["type"] = scaling.pop("rope_type")
    config["rope_scaling"] = scaling
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    ids = token_batch(model.config.vocab_size, length=96)
    np.testing.assert_allclose(af.load_target(path).score(ids), hf_logits(model, ids), rtol=0, atol=TOL)


def test_sharded_checkpoint_with_index(tmp_path):
    model = hf_tiny_model("llama", seed=7, num_hidden_layers=3, tie_word_embeddings=False)
    path = save_hf(model, tmp_path / "sharded", max_shard_size="60KB")
    shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert len(shards) > 2
    ids = token_batch(model.config.vocab_size, seed=1)
    np.testing.assert_allclose(af.load_target(path).score(ids), hf_logits(model, ids), rtol=0, atol=TOL)


def test_sliding_window_caps_context(tmp_path):
    """Sliding-window layers equal full attention only up to the window, so that is the limit."""
    model = hf_tiny_model("qwen3", seed=5, use_sliding_window=True, sliding_window=24,
                          max_window_layers=1)
    target = af.load_target(save_hf(model, tmp_path / "swa"))
    assert target.cfg.max_position_embeddings == 24
    ids = token_batch(model.config.vocab_size, length=24)
    np.testing.assert_allclose(target.score(ids), hf_logits(model, ids), rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="longer than the maximum"):
        af.generate(target, [list(range(3, 23))], max_new_tokens=8)

"""The public API (`af.load_target`, `Target.score`, `af.generate`) on good and bad input.

Bad input must raise ValueError with a message that says what is wrong and where.
"""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import adaflash_jax as af
from fixtures import params_to_hf_dir, random_params, tiny_config, tiny_target

HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
             "max_position_embeddings": 48, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
             "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def cfg():
    return tiny_config(max_position_embeddings=48)


@pytest.fixture(scope="module")
def params(cfg):
    return random_params(cfg, seed=4)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, cfg, params):
    return params_to_hf_dir(cfg, params, tmp_path_factory.mktemp("ckpt"), HF_CONFIG)


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return af.load_target(ckpt_dir)


def test_safetensors_round_trip(target, cfg, params):
    """Export (params_to_hf) then load gives the very same model."""
    ids = np.random.default_rng(0).integers(0, 256, (2, 20))
    np.testing.assert_array_equal(target.score(ids), tiny_target(cfg, seed=4).score(ids))
    assert target.tokenizer is None and target.eos_token_ids == (2,)


# ----- generate / score input validation ------------------------------------------------

@pytest.mark.parametrize("prompts,kwargs,match", [
    ([], {}, "non-empty list"),
    ([[]], {}, "prompt 0 is empty"),
    ([[5, 6], []], {}, "prompt 1 is empty"),
    ([[5, -1]], {}, r"outside the vocabulary \[0, 256\): \[-1\]"),
    ([[5, 256, 300]], {}, r"outside the vocabulary \[0, 256\): \[256, 300\]"),
    ([[5] * 41], {"max_new_tokens": 8}, "41 tokens is longer than the maximum of 40"),
    ([[5] * 10], {"max_new_tokens": 48}, "longer than the maximum"),
    ([[5]], {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ([[5]], {"max_new_tokens": -3}, "max_new_tokens must be >= 1"),
    ([[5]], {"temperature": -0.5}, "temperature must be >= 0"),
    ([[5]], {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ([[5]], {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    (["hello", [5, 6]], {}, "all strings or all token-id lists"),
    ([[5, 6], "hello"], {}, "all strings or all token-id lists"),
    ("hello", {}, "not a single string"),
    (["hello"], {}, "no tokenizer"),
])
def test_generate_rejects_bad_input(target, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        af.generate(target, prompts, **kwargs)


def test_prompt_at_the_context_limit_is_accepted(target):
    res = af.generate(target, [[5] * 40], max_new_tokens=8, stop_token_ids=[])
    assert len(res.token_ids[0]) == 8


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_text_prompt(smollm2, text):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        af.generate(smollm2, ["Hi!", text])


@pytest.mark.parametrize("ids,match", [
    ([[1, -2]], r"\[0, 256\)"), ([[255, 256]], r"\[0, 256\)"), ([1, 2], "batch, time"),
    (np.zeros((1, 0), int), "batch, time"), (np.ones((1, 49), int), "49 tokens is longer than .* 48"),
])
def test_score_rejects_bad_ids(target, ids, match):
    with pytest.raises(ValueError, match=match):
        target.score(ids)


def test_text_prompts_use_the_chat_template(smollm2):
    tok = smollm2.tokenizer
    assert tok.decode(tok.encode("Hello there")) == "Hello there"
    res = af.generate(smollm2, ["Say hello."], max_new_tokens=6)
    assert isinstance(res, af.GenerateResult) and len(res.token_ids[0]) <= 6
    assert res.texts == [tok.decode(res.token_ids[0], skip_special_tokens=True)]
    rendered = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True)
    ids = tok.encode(rendered)
    assert af.generate(smollm2, [ids], max_new_tokens=6).token_ids == res.token_ids
    for key in ("steps", "wall_time_s", "compile_time_s", "new_tokens", "tokens_per_s"):
        assert key in res.stats


# ----- checkpoint errors ----------------------------------------------------------------

def edited_checkpoint(src, dst, drop=(), add=None, config=None):
    """Copy of checkpoint `src` with tensors dropped / added / replaced and config edited."""
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(dict(HF_CONFIG, **(config or {})), f)
    return str(dst)


def load_error(path) -> str:
    with pytest.raises(ValueError) as info:
        af.load_target(path)
    return str(info.value)


def test_missing_tensor_is_named(ckpt_dir, tmp_path):
    path = edited_checkpoint(ckpt_dir, tmp_path / "c", drop=["model.layers.1.self_attn.k_proj.weight",
                                                             "lm_head.weight"])
    msg = load_error(path)
    assert "missing tensor model.layers.1.self_attn.k_proj.weight (64, 64)" in msg
    assert "missing tensor lm_head.weight (256, 64)" in msg
    assert "layers.0" not in msg and "model.layers.0.self_attn.k_proj" not in msg


def test_extra_tensors_are_named(ckpt_dir, tmp_path):
    extra = {"model.layers.0.mlp.extra.weight": np.zeros((4,), np.float32),
             "model.layers.0.self_attn.q_proj.bias": np.zeros((128,), np.float32),  # no attention_bias
             "model.layers.7.mlp.up_proj.weight": np.zeros((128, 64), np.float32),  # only 2 layers
             "vision_tower.weight": np.zeros((2,), np.float32)}
    msg = load_error(edited_checkpoint(ckpt_dir, tmp_path / "c", add=extra))
    for name in extra:
        assert f"unmapped checkpoint tensor: {name}" in msg


def test_wrong_shapes_are_named(ckpt_dir, tmp_path):
    bad = {"model.layers.0.mlp.up_proj.weight": np.zeros((100, 64), np.float32),
           "model.layers.1.self_attn.q_proj.weight": np.zeros((64, 128), np.float32),  # transposed
           "model.embed_tokens.weight": np.zeros((250, 64), np.float32)}
    msg = load_error(edited_checkpoint(ckpt_dir, tmp_path / "c", add=bad))
    assert "model.layers.0.mlp.up_proj.weight: shape (100, 64) != expected (128, 64)" in msg
    assert "model.layers.1.self_attn.q_proj.weight: shape (64, 128) != expected (128, 64)" in msg
    assert "model.embed_tokens.weight: shape (250, 64) != expected (256, 64)" in msg
    assert "missing" not in msg  # a wrong-shaped tensor is present, not missing


def test_all_problems_in_one_error(ckpt_dir, tmp_path):
    path = edited_checkpoint(ckpt_dir, tmp_path / "c", drop=["model.norm.weight"],
                             add={"model.layers.0.mlp.down_proj.weight": np.zeros((1, 1), np.float32),
                                  "junk": np.zeros((1,), np.float32)})
    msg = load_error(path)
    assert "model.norm.weight" in msg and "down_proj" in msg and "junk" in msg


@pytest.mark.parametrize("payload", [b"", b"\x00" * 3, b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json"])
def test_corrupt_safetensors(ckpt_dir, tmp_path, payload):
    path = edited_checkpoint(ckpt_dir, tmp_path / "c")
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(payload)
    assert "cannot read safetensors file" in load_error(path)


def test_truncated_safetensors(ckpt_dir, tmp_path):
    path = edited_checkpoint(ckpt_dir, tmp_path / "c")
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2])
    assert "cannot read safetensors file" in load_error(path)


def test_directory_without_config(ckpt_dir, tmp_path):
    path = edited_checkpoint(ckpt_dir, tmp_path / "c")
    os.remove(os.path.join(path, "config.json"))
    assert "no config.json" in load_error(path)


def test_directory_without_weights(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(HF_CONFIG, f)
    assert "no *.safetensors files" in load_error(str(tmp_path))


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling type 'yarn'"),
    ({"num_attention_heads": 6}, "multiple of num_kv_heads"),
])
def test_unsupported_configs(ckpt_dir, tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        af.load_target(edited_checkpoint(ckpt_dir, tmp_path / "c", config=change))


def test_config_missing_required_key(ckpt_dir, tmp_path):
    path = edited_checkpoint(ckpt_dir, tmp_path / "c")
    config = dict(HF_CONFIG)
    del config["hidden_size"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    assert "hidden_size" in load_error(path)


def test_unknown_target_name():
    msg = load_error("no-such-model-7b")
    assert "unknown target 'no-such-model-7b'" in msg and "smollm2-135m-instruct" in msg


def test_path_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"123")
    assert "neither an HF checkpoint directory nor a .gguf file" in load_error(str(path))

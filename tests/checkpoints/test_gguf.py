"""GGUF reading: parity with transformers' loader on SmolLM2, and exact round trips on tiny files."""


import gguf
import numpy as np
import pytest

from adaflash_jax.checkpoints.gguf import read_gguf, smollm2_gguf_path, undo_rotary_permutation

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2_path():
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def transformers_reference(smollm2_path, smollm2):
    """State dict and parsed config from transformers' own GGUF loader.

    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` refuses to run without
    `accelerate`, which this environment lacks; for llama files it hands the work to
    `load_gguf_checkpoint`, so that is called directly. The empty skeleton it needs only
    supplies parameter names; the config it parses is checked against ours separately.
    """
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**smollm2.config))
    loaded = load_gguf_checkpoint(smollm2_path, return_tensors=True, model_to_load=skeleton)
    state_dict = {name: tensor.numpy() for name, tensor in loaded["tensors"].items()}
    return state_dict, loaded["config"], set(skeleton.state_dict())


def test_smollm2_tensors_equal_transformers_loader(smollm2, transformers_reference):
    reference, _, model_parameters = transformers_reference
    assert set(smollm2.tensors) == set(reference)
    # Tied embeddings: the model's lm_head is the embedding, so it is the only parameter not in the file.
    assert model_parameters - set(smollm2.tensors) == {"lm_head.weight"}
    for name, expected in reference.items():
        actual = smollm2.tensors[name]
        assert actual.dtype == np.float32, name
        assert actual.shape == expected.shape, name
        np.testing.assert_array_equal(actual, expected, err_msg=name)


def test_smollm2_layouts_are_hf(smollm2):
    tensors = smollm2.tensors
    assert len(tensors) == 2 + 30 * 9
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert tensors["model.norm.weight"].shape == (576,)
    assert "lm_head.weight" not in tensors
    assert smollm2.tensor_types["model.embed_tokens.weight"] == "Q8_0"
    assert smollm2.tensor_types["model.layers.0.mlp.up_proj.weight"] == "Q4_1"
    assert smollm2.skipped_tensors == ()


def test_smollm2_config_matches_transformers_and_design(smollm2, transformers_reference):
    _, reference, _ = transformers_reference
    config = smollm2.config
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id", "rope_theta",
    ):
        assert config[key] == reference[key], key
    # transformers keeps the float32 value widened (9.9999997e-06); this reader keeps its shortest form.
    assert config["rms_norm_eps"] == pytest.approx(reference["rms_norm_eps"], rel=1e-6)
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }


def test_smollm2_metadata(smollm2, smollm2_path):
    metadata = smollm2.metadata
    assert smollm2.path == smollm2_path
    assert metadata["general.architecture"] == "llama"
    assert metadata["general.name"]
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert "<|im_start|>" in metadata["tokenizer.chat_template"]


# ----- tiny synthetic files ------------------------------------------------------------

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 96, 4, 2, 16


def llama_cpp_permute(weight, num_heads):
    """The forward Q/K permutation llama.cpp's convert_hf_to_gguf.py applies."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_weights(seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "token_embd.weight": normal(VOCAB, HIDDEN),
        "output.weight": normal(VOCAB, HIDDEN),
        "output_norm.weight": normal(HIDDEN),
        "blk.0.attn_norm.weight": normal(HIDDEN),
        "blk.0.ffn_norm.weight": normal(HIDDEN),
        "blk.0.attn_q.weight": normal(HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_q.bias": normal(HEADS * HEAD_DIM),
        "blk.0.attn_k.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_k.bias": normal(KV_HEADS * HEAD_DIM),
        "blk.0.attn_v.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.bias": normal(KV_HEADS * HEAD_DIM),
        "blk.0.attn_output.weight": normal(HIDDEN, HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": normal(FFN, HIDDEN),
        "blk.0.ffn_up.weight": normal(FFN, HIDDEN),
        "blk.0.ffn_down.weight": normal(HIDDEN, FFN),
        "rope_freqs.weight": normal(HEAD_DIM // 2),
    }


STORAGE = {
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q4_0,
    "blk.0.ffn_norm.weight": Q.F16,
    "blk.0.attn_q.weight": Q.F16,
    "blk.0.attn_k.weight": Q.Q4_0,
    "blk.0.attn_v.weight": Q.Q8_0,
    "blk.0.ffn_gate.weight": Q.Q8_0,
    "blk.0.ffn_up.weight": Q.Q4_1,
    "blk.0.attn_output.weight": Q.BF16,
    "blk.0.ffn_down.weight": Q.F16,
}  # everything else F32
ROTARY_HEADS = {"attn_q": HEADS, "attn_k": KV_HEADS}


def stored_form(name, weight):
    """What llama.cpp writes for an HF tensor: permuted if Q/K, then quantized."""
    heads = ROTARY_HEADS.get(name.split(".")[-2])
    if heads is not None:
        weight = llama_cpp_permute(weight, heads)
    return gguf.quants.quantize(weight, STORAGE.get(name, Q.F32))


def write_llama_gguf(path, weights, architecture="llama", extra_tensors=()):
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, weight in weights.items():
        qtype = STORAGE.get(name, Q.F32)
        writer.add_tensor(name, stored_form(name, weight), raw_dtype=qtype)
    for name, array in extra_tensors:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_q.bias": "model.layers.0.self_attn.q_proj.bias",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_k.bias": "model.layers.0.self_attn.k_proj.bias",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_v.bias": "model.layers.0.self_attn.v_proj.bias",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    weights = hf_weights()
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights)
    return weights, read_gguf(path)


def test_tiny_round_trip_exact(tiny):
    weights, checkpoint = tiny
    assert set(checkpoint.tensors) == set(HF_NAMES.values())
    assert checkpoint.skipped_tensors == ("rope_freqs.weight",)
    for gguf_name, hf_name in HF_NAMES.items():
        qtype = STORAGE.get(gguf_name, Q.F32)
        assert checkpoint.tensor_types[hf_name] == qtype.name
        # The exact value: the stored blocks decoded, then un-permuted.
        decoded = gguf.quants.dequantize(stored_form(gguf_name, weights[gguf_name]), qtype)
        heads = ROTARY_HEADS.get(gguf_name.split(".")[-2])
        expected = undo_rotary_permutation(decoded, heads) if heads else decoded
        actual = checkpoint.tensors[hf_name]
        assert actual.dtype == np.float32 and actual.shape == weights[gguf_name].shape, hf_name
        np.testing.assert_array_equal(actual, expected, err_msg=hf_name)


def test_tiny_values_and_permutation_undone(tiny):
    """Against the original HF tensors: exact for F32, f16-rounded for F16, within rounding error otherwise."""
    weights, checkpoint = tiny
    for gguf_name, hf_name in HF_NAMES.items():
        original, actual = weights[gguf_name], checkpoint.tensors[hf_name]
        qtype = STORAGE.get(gguf_name, Q.F32)
        if qtype == Q.F32:
            np.testing.assert_array_equal(actual, original, err_msg=hf_name)
        elif qtype == Q.F16:
            np.testing.assert_array_equal(actual, original.astype(np.float16).astype(np.float32), err_msg=hf_name)
        else:
            # Per 32-value block, Q8_0 rounds to half a step (step amax/127), Q4_0 to one step (amax/8,
            # the +amax end clips); the step itself is stored as f16, off by up to 2^-11 relative,
            # which the largest code (128 or 16 steps) multiplies.
            amax = np.abs(original).reshape(original.shape[0], -1, 32).max(axis=-1, keepdims=True)
            if qtype == Q.BF16:
                bound = amax * 2.0**-8  # 8 significant bits, rounded to nearest
            elif qtype == Q.Q8_0:
                bound = amax / 127 * (0.5 + 128 / 2048)
            elif qtype == Q.Q4_0:
                bound = amax / 8 * (1 + 16 / 2048)
            else:  # Q4_1: step (max-min)/15 <= 2*amax/15, half-step rounding, f16 step and offset
                bound = 2 * amax / 15 * (0.5 + 15 / 2048) + amax / 2048
            error = np.abs(actual - original).reshape(amax.shape[0], -1, 32)
            assert np.all(error <= bound * (1 + 1e-6)), hf_name
            # A wrong row order would be off by about the values themselves.
            assert error.max() < 0.2 * amax.max(), hf_name


def test_rotary_permutation_is_inverse():
    weight = np.arange(8 * 3 * 2, dtype=np.float32).reshape(8 * 3, 2)
    for heads in (1, 2, 3, 6):
        np.testing.assert_array_equal(undo_rotary_permutation(llama_cpp_permute(weight, heads), heads), weight)
    # Interleaved pairs (x0, y0, x1, y1) go back to HF halves (x0, x1 | y0, y1) within each head.
    np.testing.assert_array_equal(undo_rotary_permutation(np.array([0, 1, 2, 3.0]), 1), [0, 2, 1, 3])


def test_tiny_config(tiny):
    config = tiny[1].config
    assert config["num_attention_heads"] == HEADS and config["num_key_value_heads"] == KV_HEADS
    assert config["head_dim"] == HEAD_DIM and config["hidden_size"] == HIDDEN
    assert config["intermediate_size"] == FFN and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == VOCAB  # no vocab_size key: taken from the embedding
    assert config["tie_word_embeddings"] is False
    assert config["attention_bias"] is True
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert config["max_position_embeddings"] == 256
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_tied_file_has_no_lm_head(tmp_path):
    weights = {k: v for k, v in hf_weights().items() if k != "output.weight"}
    checkpoint = read_gguf(write_llama_gguf(tmp_path / "tied.gguf", weights))
    assert checkpoint.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in checkpoint.tensors


# ----- bad inputs ----------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")


def test_directory(tmp_path):
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(tmp_path)


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def test_truncated_gguf(tmp_path, smollm2_path):
    path = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as source:
        path.write_bytes(source.read(4096))
    with pytest.raises(ValueError, match="could not parse"):
        read_gguf(path)


def test_non_llama_architecture(tmp_path):
    path = write_llama_gguf(tmp_path / "other.gguf", hf_weights(), architecture="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        read_gguf(path)


def test_undecodable_tensor_type_is_named(tmp_path):
    weights = {k: v for k, v in hf_weights().items() if k != "blk.0.attn_v.bias"}
    integer_bias = ("blk.0.attn_v.bias", np.zeros(KV_HEADS * HEAD_DIM, np.int8))
    path = write_llama_gguf(tmp_path / "int.gguf", weights, extra_tensors=[integer_bias])
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_v\.bias'.*I8"):
        read_gguf(path)

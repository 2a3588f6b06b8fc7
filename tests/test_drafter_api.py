"""Drafter save/load round trips and clear errors for bad drafter inputs.

Round trips use the distilled drafter (trained weights, norms moved off 1),
so a mix-up of any two tensors changes the result.
"""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import adaflash_jax as af
import spec_helpers as H
from spec_helpers import target, drafter  # noqa: F401 (fixtures)

IDS = np.asarray([H.TEST_PROMPTS[1] + [15, 4, 15], H.TEST_PROMPTS[3][:9]], np.int32)
ZLAB_LAYER_NAMES = ("input_layernorm", "post_attention_layernorm", "mlp.down_proj", "mlp.gate_proj",
                    "mlp.up_proj", "self_attn.k_norm", "self_attn.k_proj", "self_attn.o_proj",
                    "self_attn.q_norm", "self_attn.q_proj", "self_attn.v_proj")


@pytest.fixture(scope="module")
def saved(drafter, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("drafter"))
    af.save_drafter(drafter, path)
    return path


def leaves(d):
    return jax.tree.leaves(jax.tree.map(np.asarray, d.params()))


def edited_copy(src, dst, **changes):
    """A copy of a saved drafter dir with config.json keys replaced (None deletes)."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    os.link(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))
    return dst


def test_saved_layout_is_the_published_one(drafter, saved):
    with safe_open(os.path.join(saved, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {str(f.get_tensor(k).dtype) for k in names}
    expected = {f"layers.{i}.{n}.weight" for i in range(2) for n in ZLAB_LAYER_NAMES}
    assert names == expected | {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert dtypes == {"torch.float32"}
    with open(os.path.join(saved, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["block_size"] == H.BLOCK and cfg["num_target_layers"] == H.TINY.num_layers
    assert cfg["dflash_config"] == {"target_layer_ids": list(drafter.cfg.target_layer_ids),
                                    "mask_token_id": drafter.cfg.mask_token_id}
    assert cfg["model_type"] == "qwen3" and cfg["num_hidden_layers"] == 2


def test_fp32_round_trip_is_exact(target, drafter, saved):
    loaded = af.load_drafter(saved, target=target)
    assert loaded.cfg == drafter.cfg
    for a, b in zip(leaves(drafter), leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(af.draft_logits(target, loaded, IDS),
                                  af.draft_logits(target, drafter, IDS))


def test_length_head_saves_and_loads_with_the_drafter(target, drafter, saved, tmp_path):
    from flax import nnx

    from adaflash_jax.models.length_head import LengthHead

    assert not af.load_drafter(saved, target=target).has_length_head
    head = LengthHead(drafter.cfg.hidden_size, 8, rngs=nnx.Rngs(4))
    with_head = drafter.with_length_head(head)
    af.save_drafter(with_head, str(tmp_path))
    config = json.load(open(tmp_path / "config.json"))
    assert config["dflash_config"]["use_thresh_head_two_model"]
    assert config["dflash_config"]["mask_token_id"] == drafter.cfg.mask_token_id  # drafter keys kept
    loaded = af.load_drafter(str(tmp_path), target=target)
    x = jax.random.normal(jax.random.key(1), (2, drafter.block_size, drafter.cfg.hidden_size))
    np.testing.assert_array_equal(np.asarray(loaded.length_head(x)), np.asarray(head(x)))
    assert loaded.with_block_size(8).has_length_head
    assert not loaded.with_length_head(None).has_length_head
    with pytest.raises(ValueError, match="hidden size"):
        drafter.with_length_head(LengthHead(drafter.cfg.hidden_size + 1, 8, rngs=nnx.Rngs(0)))


def test_bf16_save_loads_close(target, drafter, tmp_path):
    af.save_drafter(drafter, str(tmp_path), dtype="bfloat16")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    loaded = af.load_drafter(str(tmp_path), target=target)  # computes in the target's fp32
    for a, b in zip(leaves(drafter), leaves(loaded), strict=True):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), b)
    ref = af.draft_logits(target, drafter, IDS)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(af.draft_logits(target, loaded, IDS), ref, atol=0.02 * scale, rtol=0)
    # bf16 arithmetic (measured like torch's bf16 run of the same layers): the bulk of the
    # logits stays at bf16 rounding level; single elements drift more, so check the argmax
    in_bf16 = af.load_drafter(str(tmp_path), target=target, dtype="bfloat16")
    assert in_bf16.cfg.dtype == "bfloat16"
    low = af.draft_logits(target, in_bf16, IDS)
    assert np.median(np.abs(low - ref)) < 0.005 * scale
    assert np.mean(low.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_bf16_drafter_decodes_losslessly(target, tmp_path):
    """Drafter precision may change acceptance, never the (greedy) output."""
    af.save_drafter(H.distilled_drafter(), str(tmp_path), dtype="bfloat16")
    drafter = af.load_drafter(str(tmp_path), target=target, dtype="bfloat16")
    kw = dict(max_new_tokens=40, stop_token_ids=())
    ar = af.generate(target, H.TEST_PROMPTS, **kw)
    res = af.generate(target, H.TEST_PROMPTS, drafter=drafter, verify="chain", **kw)
    assert res.token_ids == ar.token_ids
    assert res.stats["mean_tau"] > 2.0


def test_save_overwrites_a_drafter_but_not_other_checkpoints(drafter, saved, tmp_path):
    af.save_drafter(drafter, saved)  # a drafter dir may be overwritten
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        af.save_drafter(drafter, str(other))
    assert sorted(os.listdir(other)) == ["config.json"]
    assert json.loads((other / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(ValueError, match="save dtype"):
        af.save_drafter(drafter, str(tmp_path / "fp16"), dtype="float16")


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=48), "hidden size 32 != target's 48"),
    (dict(vocab_size=48), "vocab size 32 != target's 48"),
    (dict(num_layers=8), "expects a 6-layer target"),
])
def test_load_into_a_different_target_fails(saved, changes, message):
    other = H.numpy_target(**changes)
    with pytest.raises(ValueError, match=message):
        af.load_drafter(saved, target=other)


@pytest.mark.parametrize("changes, message", [
    (dict(dflash_config={"target_layer_ids": [1, 9], "mask_token_id": 31}), r"\[9\] are out of range"),
    (dict(num_target_layers=8), "expects a 8-layer target, target has 6"),
    (dict(dflash_config=None), "not a DFlash drafter"),
    (dict(num_target_layers=None, dflash_config={"target_layer_ids": [1, 7], "mask_token_id": 31}),
     "out of range for 6 layers"),
])
def test_bad_drafter_config_fails_at_load(target, saved, tmp_path, changes, message):
    path = edited_copy(saved, str(tmp_path / "edited"), **changes)
    with pytest.raises(ValueError, match=message):
        af.load_drafter(path, target=target)


def test_init_drafter_rejects_bad_shapes(target):
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        af.init_drafter(target, block_size=1)
    with pytest.raises(ValueError, match="out of range"):
        af.init_drafter(target, target_layer_ids=(0, 6))
    with pytest.raises(ValueError, match="distinct"):
        af.init_drafter(target, target_layer_ids=(1, 1))


@pytest.mark.parametrize("kw, message", [
    (dict(block_size=1), "block_size must be >= 2"),
    (dict(block_size=H.BLOCK + 1), "exceeds the drafter's trained block size"),
    (dict(verify_len=0), r"verify_len must lie in \[1, block_size=16\]"),
    (dict(verify_len=H.BLOCK + 1), r"verify_len must lie in \[1, block_size=16\]"),
    (dict(block_size=8, verify_len=9), r"verify_len must lie in \[1, block_size=8\]"),
    (dict(verify_len=[2, 0, 3, 4]), "verify_len must lie in"),
    (dict(verify_len=[2, 3]), "one int per prompt"),
])
def test_generate_rejects_bad_speculative_options(target, drafter, kw, message):
    with pytest.raises(ValueError, match=message):
        af.generate(target, H.TEST_PROMPTS, drafter=drafter, max_new_tokens=4, **kw)


def test_generate_rejects_a_drafter_for_another_target(drafter):
    with pytest.raises(ValueError, match="drafter does not match the target"):
        af.generate(H.numpy_target(num_layers=8), [[1, 2, 3]], drafter=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="need a drafter"):
        af.generate(H.numpy_target(), [[1, 2, 3]], block_size=4, max_new_tokens=4)


def test_draft_logits_rejects_bad_ids(target, drafter):
    with pytest.raises(ValueError, match="time >= 2"):
        af.draft_logits(target, drafter, [[3]])
    with pytest.raises(ValueError, match="must lie in"):
        af.draft_logits(target, drafter, [[3, H.TINY.vocab_size]])

"""Sharded targets on the 8 forced host devices give the single-device results.

The tiny config's heads, MLP width, vocab and hidden size all divide the meshes, so
the rules really shard (checked on the arrays), rather than falling back to replication.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import adaflash_jax as af
from adaflash_jax.parallel.mesh import make_mesh
from adaflash_jax.parallel.rules import batch_sharding, logical_to_spec
from fixtures import params_to_hf_dir, random_params, tiny_config, tiny_target

# Sharding splits contractions (fsdp: the embed dim; tensor: heads / MLP rows) into partial
# sums added in another order, so logits differ by float32 rounding that grows with their
# size (these reach ~15; measured max difference 1.8e-5). The bound is 1e-5 of the largest
# |logit|; a wrong partition or missing reduction is off by O(1) of it.
REL_TOL = 1e-5
MESHES = {"data2-tensor4": dict(data=2, fsdp=1, tensor=4), "data2-fsdp2-tensor2": dict(data=2, fsdp=2, tensor=2)}


@pytest.fixture(scope="module")
def single():
    return tiny_target(tiny_config(), seed=3)


@pytest.fixture(scope="module", params=sorted(MESHES))
def sharded(request):
    mesh = make_mesh(**MESHES[request.param])
    return tiny_target(tiny_config(), seed=3, mesh=mesh)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(8)
    return [rng.integers(3, 256, n).tolist() for n in (5, 19, 2, 11)]


def test_eight_host_devices():
    assert jax.device_count() == 8


def test_parameters_are_sharded(sharded):
    mesh = sharded.mesh
    wq = sharded.state["layers"]["wq"][...]
    embed = sharded.state["embed"][...]
    w_down = sharded.state["layers"]["w_down"][...]
    assert wq.sharding.spec == P(None, "fsdp", "tensor", None)
    assert embed.sharding.spec == P("tensor", "fsdp")
    assert w_down.sharding.spec == P(None, "tensor", "fsdp")
    # Each device holds only its slice of the weight.
    shard_shape = wq.addressable_shards[0].data.shape
    assert shard_shape[2] == wq.shape[2] // mesh.shape["tensor"]
    assert not wq.sharding.is_fully_replicated and len(wq.sharding.device_set) == 8


def assert_logits_close(got, want):
    assert np.abs(want).max() > 5
    np.testing.assert_allclose(got, want, rtol=0, atol=REL_TOL * np.abs(want).max())


def test_score_matches_single_device(single, sharded):
    ids = np.random.default_rng(0).integers(0, 256, (4, 24))
    assert_logits_close(sharded.score(ids), single.score(ids))


def test_odd_batch_falls_back_to_replicated_inputs(single, sharded):
    ids = np.random.default_rng(1).integers(0, 256, (3, 9))
    assert_logits_close(sharded.score(ids), single.score(ids))


def test_greedy_generate_matches_single_device(single, sharded, prompts):
    want = af.generate(single, prompts, max_new_tokens=16, stop_token_ids=[]).token_ids
    assert af.generate(sharded, prompts, max_new_tokens=16, stop_token_ids=[]).token_ids == want


def test_sampled_generate_matches_single_device(single, sharded, prompts):
    kwargs = dict(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5, stop_token_ids=[])
    assert af.generate(sharded, prompts, **kwargs).token_ids == af.generate(single, prompts, **kwargs).token_ids


def test_load_target_with_mesh(single, tmp_path):
    cfg = tiny_config()
    hf_config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
    path = params_to_hf_dir(cfg, random_params(cfg, seed=3), tmp_path / "ckpt", hf_config)
    loaded = af.load_target(path, mesh=make_mesh(data=2, tensor=4))
    assert loaded.state["layers"]["w_gate"][...].sharding.spec == P(None, "fsdp", "tensor")
    ids = np.random.default_rng(2).integers(0, 256, (2, 16))
    assert_logits_close(loaded.score(ids), single.score(ids))


def test_rules_replicate_what_the_mesh_does_not_divide():
    mesh = make_mesh(data=2, fsdp=1, tensor=4)
    assert logical_to_spec(("layers", "embed", "q_heads", "head_dim"), (2, 576, 9, 64), mesh) == \
        P(None, "fsdp", None, None)  # SmolLM2's 9 heads do not split 4 ways
    assert logical_to_spec(("vocab", "embed"), (49152, 576), mesh) == P("tensor", "fsdp")
    assert batch_sharding(mesh, 2, 4).spec == P(("data", "fsdp"), None)
    assert batch_sharding(mesh, 2, 3).spec == P(None, None)
    with pytest.raises(ValueError, match="rank"):
        logical_to_spec(("vocab",), (3, 4), mesh)


def test_make_mesh_validates_sizes():
    with pytest.raises(ValueError, match="product equals the device count"):
        make_mesh(data=2, fsdp=2, tensor=4)
    with pytest.raises(ValueError, match=">= 1"):
        make_mesh(data=0, tensor=8)
    mesh = make_mesh(tensor=8)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 8}

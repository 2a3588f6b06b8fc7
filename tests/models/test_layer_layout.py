"""The two layer layouts: exact conversion, the same outputs, and no weight or cache copies.

The per-layer inference layout exists so that XLA reads each layer's weights and
KV-cache buffers in place. The optimised programs of the engine's AR step, fixed
(chain) verify step and tree step are read for copies of a layer's weight or a
cache buffer, so one cannot come back silently; the stacked layout's programs do
hold such copies, which shows the check can fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adaflash_jax as af

from adaflash_jax.decoding import engine
from adaflash_jax.decoding.autoregressive import new_cache
from adaflash_jax.drafter_api import init_drafter
from adaflash_jax.decoding.engine_state import EngineConfig, EngineWeights
from adaflash_jax.decoding.slot_params import SlotParams
from adaflash_jax.eval.hlo import weight_and_cache_copies
from adaflash_jax.models.config import ModelConfig
from adaflash_jax.models.decoder_layers import to_layout
from adaflash_jax.target_api import target_from_params
from fixtures import random_params, tiny_config

# Odd sizes, so no activation of these steps has the element count of a layer weight or cache.
ODD = ModelConfig(vocab_size=40, hidden_size=48, intermediate_size=112, num_layers=4, num_heads=2,
                  num_kv_heads=1, head_dim=24, max_position_embeddings=256)
SLOTS, CACHE, BLOCK = 2, 80, 8


def test_conversion_round_trip_is_exact():
    cfg = tiny_config(num_layers=3)
    stacked = target_from_params(cfg, random_params(cfg, seed=4), layer_layout="stacked")
    per_layer = to_layout(stacked.model, "per_layer")
    assert per_layer.layers.per_layer and len(per_layer.layers.items) == 3
    for i, layer in enumerate(per_layer.layers.layer_arrays(jnp.float32)):
        for name, w in stacked.model.layers.arrays(jnp.float32).items():
            np.testing.assert_array_equal(np.asarray(layer[name]), np.asarray(w[i]))
    back = to_layout(per_layer, "stacked")
    for name, w in stacked.model.layers.arrays(jnp.float32).items():
        np.testing.assert_array_equal(np.asarray(back.layers.arrays(jnp.float32)[name]), np.asarray(w))
    with pytest.raises(ValueError, match="unknown layer layout"):
        to_layout(back, "unrolled")


def test_layouts_score_the_same():
    cfg = tiny_config(num_layers=3)
    params = random_params(cfg, seed=5)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    stacked = target_from_params(cfg, params, layer_layout="stacked").score(ids)
    per_layer = target_from_params(cfg, params, layer_layout="per_layer").score(ids)
    np.testing.assert_allclose(per_layer, stacked, rtol=0, atol=1e-5)


def test_a_cache_of_the_other_layout_is_refused():
    cfg = tiny_config()
    params = random_params(cfg)
    per_layer = target_from_params(cfg, params, layer_layout="per_layer").model
    stacked = target_from_params(cfg, params, layer_layout="stacked").model
    tokens = jnp.ones((1, 2), jnp.int32)

    with pytest.raises(ValueError, match="per-layer KV cache"):
        per_layer(tokens, cache=new_cache(stacked, 1, 16))
    with pytest.raises(ValueError, match="stacked KV cache"):
        stacked(tokens, cache=new_cache(per_layer, 1, 16))


def _step_copies(target, drafter, **modes) -> dict:
    cfg = EngineConfig(target_def=target.graphdef, cache_len=CACHE, max_new_cap=16, greedy=True,
                       drafter_def=None if drafter is None else drafter.graphdef,
                       block_size=0 if drafter is None else BLOCK, **modes)
    weights = EngineWeights(target.state, None if drafter is None else drafter.state, None)
    state = engine.init_state_jit(cfg, weights, SLOTS, jnp.asarray([2], jnp.int32), None)
    params = SlotParams.build([4, 4], temperature=1.0, top_p=1.0, seeds=0, streams=0, verify_len=BLOCK)
    state = engine.insert_jit(cfg, weights, state, jnp.arange(SLOTS, dtype=jnp.int32),
                              jnp.ones((SLOTS, 8), jnp.int32), jnp.asarray([5, 8], jnp.int32), params)
    donating = jax.jit(engine.step, static_argnums=0, donate_argnums=2)  # as the decode programs run it
    text = donating.lower(cfg, weights, state).compile().as_text()
    return weight_and_cache_copies(text, target.model, SLOTS, CACHE)


@pytest.fixture(scope="module")
def odd_models():
    params = random_params(ODD, seed=1)
    targets = {layout: target_from_params(ODD, params, layer_layout=layout) for layout in ("per_layer", "stacked")}
    drafter = init_drafter(targets["per_layer"], num_layers=1, block_size=BLOCK, seed=0)
    return targets, drafter


@pytest.mark.parametrize("kind", ["ar", "chain", "tree"])
def test_no_step_copies_a_weight_or_slices_a_cache(odd_models, kind):
    targets, drafter = odd_models
    modes = {"ar": {}, "chain": dict(verify="chain"), "tree": dict(verify="tree", tree_budget=8)}[kind]
    uses = None if kind == "ar" else drafter
    copies = _step_copies(targets["per_layer"], uses, **modes)
    assert copies["weight"] == 0 and copies["weight_slices"] == 0 and copies["cache_slices"] == 0, copies
    # At most the keys' transpose for the score matmul (XLA picks it by shape), once per layer.
    assert copies["cache"] <= ODD.num_layers, copies
    stacked = _step_copies(targets["stacked"], uses, **modes)
    assert stacked["weight_slices"] > 0, stacked  # the scan slices (copies) every weight


MODES = [{}, dict(verify="chain", length_policy="fixed"), dict(verify="tree", tree_budget=8)]


@pytest.mark.parametrize("mode", MODES)
def test_generate_gives_the_same_tokens_in_both_layouts(mode):
    """AR, the adaptive default and the fixed modes decode through the per-layer caches (prefill,
    row inserts, packed and tree verification, path compaction) to the stacked layout's tokens."""
    cfg = tiny_config(num_layers=4)
    params = random_params(cfg, seed=6)
    targets = [target_from_params(cfg, params, layer_layout=layout) for layout in ("stacked", "per_layer")]
    drafter = init_drafter(targets[0], num_layers=1, block_size=BLOCK, seed=0)
    prompts = [[5, 17, 3, 9], [2, 2, 8, 19, 27, 6, 11]]
    outs = [af.generate(t, prompts, max_new_tokens=12, drafter=drafter, **mode).token_ids for t in targets]
    assert outs[0] == outs[1]
    if not mode:
        assert [af.generate(t, prompts, max_new_tokens=12).token_ids for t in targets][0] == outs[0]

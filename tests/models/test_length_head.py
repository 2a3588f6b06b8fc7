"""The adaptive length head: labels against a brute-force count, the verify-length rule, no
gradient into the drafter, and a head that learns to rank blocks by acceptance."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from adaflash_jax.models.length_head import LengthHead, accepted_counts, length_labels, length_loss


def brute_force_accepted(drafts, labels, valid):
    a = 0
    for k in range(1, len(drafts)):
        if not (valid[k] and drafts[k] == labels[k]):
            break
        a += 1
    return a


def test_labels_match_a_brute_force_count():
    rng = np.random.default_rng(0)
    bs = 16
    labels = rng.integers(0, 4, (200, bs))
    drafts = np.where(rng.random((200, bs)) < 0.8, labels, rng.integers(0, 4, (200, bs)))
    valid = np.arange(bs)[None] < rng.integers(1, bs + 1, (200, 1))
    got = np.asarray(accepted_counts(jnp.asarray(drafts), jnp.asarray(labels), jnp.asarray(valid)))
    want = [brute_force_accepted(d, lab, v) for d, lab, v in zip(drafts, labels, valid)]
    np.testing.assert_array_equal(got, want)
    assert got.max() == bs - 1 or (got < bs - 1).all()
    s = np.asarray(length_labels(jnp.asarray(got), bs))
    np.testing.assert_allclose(s, np.minimum(np.asarray(want) + 1, bs) / bs)


def test_no_gradient_reaches_the_drafter_hidden_states():
    head = LengthHead(8, 16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 4, 8))
    g = jax.grad(lambda h: head(h).sum())(x)
    assert float(jnp.abs(g).max()) == 0.0
    assert head(x).shape == (3,) and bool(((head(x) > 0) & (head(x) < 1)).all())


def test_head_learns_to_rank_blocks_by_acceptance():
    """Synthetic blocks whose hidden states carry their acceptance; the trained head's
    prediction correlates with the true label on held-out blocks."""
    rng = np.random.default_rng(0)
    bs, d = 8, 16
    direction = rng.normal(size=d)

    def blocks(n):
        a = rng.integers(0, bs, n)
        h = rng.normal(size=(n, bs, d)) + (a[:, None, None] / bs) * direction * 2.0
        return jnp.asarray(h, jnp.float32), length_labels(jnp.asarray(a), bs)

    h_train, s_train = blocks(512)
    h_test, s_test = blocks(256)
    head = LengthHead(d, 32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(head)
    tx = optax.adamw(3e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        loss, g = jax.value_and_grad(
            lambda p: length_loss(nnx.merge(graphdef, p)(h_train), s_train, jnp.ones(512)))(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    first = None
    for _ in range(300):
        params, opt, loss = step(params, opt)
        first = loss if first is None else first
    pred = np.asarray(nnx.merge(graphdef, params)(h_test))
    corr = np.corrcoef(pred, np.asarray(s_test))[0, 1]
    assert float(loss) < 0.5 * float(first) and corr > 0.8, (float(first), float(loss), corr)


def test_published_layout_round_trip(tmp_path):
    import json

    from adaflash_jax.checkpoints import drafter_hf
    from adaflash_jax.models.drafter import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=8, vocab_size=40, target_layer_ids=(1,), num_target_layers=4,
                        mask_token_id=3, block_size=4)
    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(0))
    head = LengthHead(16, 8, rngs=nnx.Rngs(5))
    tensors, keys = drafter_hf.length_head_to_hf(head)
    assert tensors["thresh_head_two_model.down.weight"].shape == (8, 32)  # torch Linear: [out, in]
    hf_cfg = drafter_hf.config_to_hf(cfg)
    hf_cfg["dflash_config"].update(keys)
    params = nnx.to_pure_dict(nnx.state(drafter, nnx.Param))
    drafter_hf.save(cfg, params, str(tmp_path), extra_tensors=tensors,
                    extra_config={"dflash_config": hf_cfg["dflash_config"]})
    assert json.load(open(tmp_path / "config.json"))["dflash_config"]["use_thresh_head_two_model"]
    _, _, raw_cfg, extras = drafter_hf.load(str(tmp_path), extra_prefixes=(drafter_hf.LENGTH_HEAD_PREFIX,))
    loaded = drafter_hf.length_head_from_hf(extras, raw_cfg, 16)
    x = jax.random.normal(jax.random.key(0), (3, 4, 16))
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(head(x)), rtol=1e-6)
    assert drafter_hf.length_head_from_hf({}, {"dflash_config": {}}, 16) is None
    with pytest.raises(ValueError, match="missing"):
        drafter_hf.length_head_from_hf({}, raw_cfg, 16)


def test_confidence_input_round_trip_and_checks(tmp_path):
    """A head with the confidence input: the running products enter its first layer, it saves
    and loads with its extra tensor, and a missing / unexpected / mis-sized input is refused."""
    from adaflash_jax.checkpoints import drafter_hf
    from adaflash_jax.models.length_head import HF_CONFIDENCE_NAME, draft_confidence

    head = LengthHead(16, 8, rngs=nnx.Rngs(5), confidence_width=3)
    x = jax.random.normal(jax.random.key(0), (5, 4, 16))
    conf = jax.random.uniform(jax.random.key(1), (5, 3))
    running = np.cumprod(np.asarray(conf, np.float64), -1)
    prior = (1 + running.sum(-1)) / 4  # the drafter's own expected fraction: a fresh head's score
    np.testing.assert_allclose(np.asarray(head(x, conf)), prior, rtol=1e-5)
    head.w_out[...] = jax.random.normal(jax.random.key(2), head.w_out[...].shape)
    u = jnp.concatenate([x.mean(1), x[:, -1]], -1)
    g = jax.nn.silu(u @ head.w_down[...] + head.b_down[...] + jnp.asarray(running, jnp.float32) @ head.w_conf[...])
    g = g + jax.nn.silu(g @ head.w_res[...] + head.b_res[...])
    want = jax.nn.sigmoid((g @ head.w_out[...] + head.b_out[...])[:, 0] + np.log(prior / (1 - prior)))
    np.testing.assert_allclose(np.asarray(head(x, conf)), np.asarray(want), rtol=1e-5)
    assert float(jnp.abs(jax.grad(lambda c: head(x, c).sum())(conf)).max()) == 0.0  # inputs stay detached

    tensors, keys = drafter_hf.length_head_to_hf(head)
    assert tensors[HF_CONFIDENCE_NAME].shape == (8, 3) and keys["thresh_head_confidence_width"] == 3
    loaded = drafter_hf.length_head_from_hf(tensors, {"dflash_config": keys}, 16)
    np.testing.assert_allclose(np.asarray(loaded(x, conf)), np.asarray(head(x, conf)), rtol=1e-6)
    with pytest.raises(ValueError, match="missing"):
        drafter_hf.length_head_from_hf({k: v for k, v in tensors.items() if k != HF_CONFIDENCE_NAME},
                                       {"dflash_config": keys}, 16)
    with pytest.raises(ValueError, match="needs the drafts' confidence"):
        head(x)
    with pytest.raises(ValueError, match="takes no confidence input"):
        LengthHead(16, 8, rngs=nnx.Rngs(0))(x, conf)
    with pytest.raises(ValueError, match="built for 3"):
        head(x, conf[:, :2])
    logits = jnp.log(jnp.asarray([[0.7, 0.2, 0.1], [0.25, 0.5, 0.25]]))
    np.testing.assert_allclose(np.asarray(draft_confidence(logits)), [0.7, 0.5], rtol=1e-6)

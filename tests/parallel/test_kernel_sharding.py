"""Pallas kernels under a mesh run per device shard and give the single-device results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from adaflash_jax.parallel.kernel_sharding import current_mesh, per_shard
from adaflash_jax.parallel.mesh import make_mesh
from adaflash_jax.training.config import load_config, override
from adaflash_jax.training.trainer import train
from pallas_kernels.block_attention_train import block_attention_train, block_attention_train_reference


def test_per_shard_splits_batch_and_heads():
    mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
    seen = []

    def kernel(q, lengths):
        seen.append((q.shape, lengths.shape))
        return q * lengths[:, None, None].astype(q.dtype)

    q = jnp.arange(4 * 4 * 3, dtype=jnp.float32).reshape(4, 4, 3)
    lengths = jnp.arange(4, dtype=jnp.int32)
    with jax.set_mesh(mesh):
        assert current_mesh() is not None
        out = jax.jit(lambda a, b: per_shard(kernel, (a, b), (1, None)))(q, lengths)
    assert seen == [((2, 2, 3), (2,))]  # each device: half the rows, half the heads
    np.testing.assert_array_equal(out, q * lengths[:, None, None])
    assert current_mesh() is None


def test_training_kernel_gradients_under_a_mesh_match_one_device():
    rng = np.random.default_rng(0)
    b, h, hkv, n, bs, t, dh = 4, 4, 2, 2, 8, 24, 16
    q = jnp.asarray(rng.normal(size=(b, h, n * bs, dh)), jnp.float32)
    ck, cv = (jnp.asarray(rng.normal(size=(b, hkv, t, dh)), jnp.float32) for _ in range(2))
    bk, bv = (jnp.asarray(rng.normal(size=(b, hkv, n * bs, dh)), jnp.float32) for _ in range(2))
    anchors = jnp.asarray(rng.integers(0, t, size=(b, n)), jnp.int32)

    def loss(kernel, *xs):
        return jnp.sum(per_shard(kernel, (*xs, anchors), (1, 1, 1, 1, 1, None)) ** 2)

    pallas = lambda *xs: block_attention_train(*xs, block_size=bs, impl="pallas")  # noqa: E731
    ref = lambda *xs: block_attention_train_reference(*xs, block_size=bs)  # noqa: E731
    want = jax.grad(lambda *xs: loss(ref, *xs), argnums=(0, 1, 2, 3, 4))(q, ck, cv, bk, bv)
    mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
    shard = NamedSharding(mesh, PartitionSpec("data", "tensor"))
    args = [jax.device_put(x, shard) for x in (q, ck, cv, bk, bv)]
    with jax.set_mesh(mesh):
        got = jax.jit(jax.grad(lambda *xs: loss(pallas, *xs), argnums=(0, 1, 2, 3, 4)))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)


def test_trainer_with_pallas_on_a_mesh_matches_xla(tmp_path, monkeypatch):
    def run(impl):
        cfg = override(load_config("tiny"), [
            f"attn_impl={impl}", "optim.total_steps=2", "data.num_sequences=16", "data.eval_sequences=8",
            "data.batch_size=4", "data.num_blocks=4", "eval_every=100", "log_every=1", "progress=false",
            f"checkpoint.dir={tmp_path / impl}", "checkpoint.every_steps=100", "mesh.data=2"])
        return train(cfg).losses

    ref = run("xla")
    calls = []
    original = jax.shard_map
    monkeypatch.setattr(jax, "shard_map", lambda *a, **k: calls.append(k["in_specs"]) or original(*a, **k))
    got = run("pallas")
    assert calls and calls[0][0] == PartitionSpec("data", None, None, None)  # per shard, not gathered
    np.testing.assert_allclose([got[s] for s in sorted(got)], [ref[s] for s in sorted(ref)], rtol=1e-4)

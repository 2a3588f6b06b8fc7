"""The engine and the trainer with impl="pallas" (interpret mode on CPU) equal impl="xla".

Decoding runs all three kernels: the drafter's block attention, packed
verification attention (the "head" length policy verifies through the packed
layout) and the fused verify head (greedy argmax of drafts and verified
tokens). Training runs the block-sparse training kernel forward and backward.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
from adaflash_jax.models import layers
from adaflash_jax.models import target as target_module
from adaflash_jax.models.length_head import LengthHead
from adaflash_jax.training.config import load_config, override
from adaflash_jax.training.trainer import train
from spec_helpers import TEST_PROMPTS, tiny_target


@pytest.fixture(scope="module")
def drafter():
    target = tiny_target()
    d = af.init_drafter(target, num_layers=2, block_size=8, seed=1)
    return d.with_length_head(LengthHead(target.cfg.hidden_size, 8, rngs=nnx.Rngs(0)))


def count_calls(monkeypatch, module, name: str, counts: dict):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("policy,kernels", [
    ("fixed", {"block_attention", "verify_head"}),
    ("head", {"block_attention", "verify_attention", "verify_head"}),
])
def test_engine_with_pallas_kernels_matches_xla(drafter, policy, kernels, monkeypatch):
    kwargs = dict(max_new_tokens=12, drafter=drafter, length_policy=policy, rho=0.6)
    ref = af.generate(tiny_target(), TEST_PROMPTS, **kwargs)
    traced: dict = {}  # entry points reached while tracing the pallas loop
    for module, name in ((layers, "block_attention"), (layers, "verify_attention"),
                         (target_module, "verify_head")):
        count_calls(monkeypatch, module, name, traced)
    got = af.generate(tiny_target(), TEST_PROMPTS, attn_impl="pallas", **kwargs)
    assert set(traced) == kernels
    assert got.token_ids == ref.token_ids
    assert got.stats["acceptance_lengths"] == ref.stats["acceptance_lengths"]
    if policy == "head":
        assert got.stats["mean_verify_len"] < 8  # the packed path, not whole blocks


def test_trainer_with_pallas_kernels_matches_xla(tmp_path, monkeypatch):
    def run(impl):
        cfg = override(load_config("tiny"), [
            f"attn_impl={impl}", "optim.total_steps=3", "data.num_sequences=16", "data.eval_sequences=8",
            "data.batch_size=4", "data.num_blocks=4", "eval_every=100", "log_every=1", "progress=false",
            f"checkpoint.dir={tmp_path / impl}", "checkpoint.every_steps=100"])
        return train(cfg)

    ref = run("xla")
    traced: dict = {}
    count_calls(monkeypatch, layers, "block_attention_train", traced)
    got = run("pallas")
    assert traced.get("block_attention_train", 0) >= 1
    steps = sorted(ref.losses)
    assert steps == sorted(got.losses) and len(steps) == 3
    np.testing.assert_allclose([got.losses[s] for s in steps], [ref.losses[s] for s in steps],
                               rtol=1e-4, atol=1e-5)
    for a, b in zip(jax_leaves(ref.drafter.state), jax_leaves(got.drafter.state)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=1e-5)


def jax_leaves(state):
    import jax
    return jax.tree_util.tree_leaves(state)


def test_attn_impl_is_validated_in_configs():
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        override(load_config("tiny"), ["attn_impl=triton"])


def test_sampled_engine_with_pallas_draws_the_verify_heads_tokens(drafter):
    """At T > 0 the Pallas head samples with the same counter-based noise as its XLA reference,
    so the kernels reproduce the reference's tokens exactly (packed "head" verification)."""
    kwargs = dict(max_new_tokens=12, drafter=drafter, length_policy="head", rho=0.6, temperature=0.8,
                  seed=3)
    ref = af.generate(tiny_target(), TEST_PROMPTS, verify_head=True, **kwargs)
    got = af.generate(tiny_target(), TEST_PROMPTS, attn_impl="pallas", **kwargs)
    assert got.token_ids == ref.token_ids
    assert got.stats["acceptance_lengths"] == ref.stats["acceptance_lengths"]

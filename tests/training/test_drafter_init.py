"""A new drafter's starting point (reduced draft vocabulary, target layers) and timed runs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
from adaflash_jax.models import layers
from adaflash_jax.training import trainer
from adaflash_jax.training.drafter_init import init_from_target_layers


def test_reduced_vocabulary_run_trains_saves_and_keeps_its_table(tiny_train_env, tmp_path):
    cfg = tiny_train_env.config(tmp_path, "drafter.draft_vocab_size=48", "optim.total_steps=120",
                                "eval_every=60")
    result = trainer.train(cfg, target=tiny_train_env.target)
    d2t = np.load(tmp_path / "d2t.npy")
    assert d2t.shape == (48,) and np.all(np.diff(d2t) > 0)
    taus = [e["tau_teacher_forced"] for e in result.evals]
    assert taus[-1] > taus[0] + 0.3, taus
    loaded = af.load_drafter(result.drafter_dir, target=tiny_train_env.target)
    assert np.array_equal(np.asarray(loaded.module.d2t[...]), d2t)
    rows = [[int(t) for t in tiny_train_env.arrays["tokens"][0, :20]]]
    ar = af.generate(tiny_train_env.target, rows, max_new_tokens=24, stop_token_ids=())
    spec = af.generate(tiny_train_env.target, rows, drafter=loaded, max_new_tokens=24, stop_token_ids=())
    assert spec.token_ids == ar.token_ids
    # the table belongs to the run: a resume asking for another size is refused
    bigger = tiny_train_env.config(tmp_path, "drafter.draft_vocab_size=64", "optim.total_steps=130")
    with pytest.raises(ValueError, match="draft vocabulary of 48"):
        trainer.train(bigger, target=tiny_train_env.target)


def test_target_layer_init_reproduces_the_target_layers_context_kv(tiny_train_env):
    target = tiny_train_env.target
    module = nnx.merge(target.graphdef, target.state)
    drafter = af.init_drafter(target, num_layers=1, block_size=8, target_layer_ids=(0, 2)).module
    init_from_target_layers(drafter, module)
    L = target.cfg.num_layers
    ids = jnp.asarray(tiny_train_env.arrays["tokens"][:2, :16])
    out = module(ids, feature_layers=(0, 2))
    positions = jnp.broadcast_to(jnp.arange(16)[None], (2, 16))
    k, v = drafter.context_kv(out.features, positions)
    # the target's own layer L-1 keys/values of its input (= output of layer L-2)
    p = {name: x[L - 1] for name, x in module.layers.arrays(jnp.float32).items()}
    h = layers.rms_norm(out.features[..., target.cfg.hidden_size:], p["attn_norm"], target.cfg.rms_norm_eps)
    cos, sin = drafter._rope(positions)
    tv = jnp.einsum("btd,dhk->bhtk", h, p["wv"])
    tk = layers.apply_rope(layers.rms_norm(jnp.einsum("btd,dhk->bhtk", h, p["wk"]), jnp.ones(16),
                                           target.cfg.rms_norm_eps), cos, sin)
    np.testing.assert_allclose(np.asarray(v[0]), np.asarray(tv), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(k[0]), np.asarray(tk), rtol=1e-4, atol=1e-4)


def test_max_minutes_stops_at_a_checkpoint_and_resume_keeps_the_clock(tiny_train_env, tmp_path):
    cfg = tiny_train_env.config(tmp_path, "optim.total_steps=20", "max_minutes=0.0001",
                                "checkpoint.every_steps=10", "eval_every=10")
    first = trainer.train(cfg, target=tiny_train_env.target)
    assert first.time_limited and not first.finished and first.step < 20
    clock = json.loads((tmp_path / "train_time.json").read_text())
    assert str(first.step) in clock
    second = trainer.train(tiny_train_env.config(tmp_path, "optim.total_steps=20"),
                           target=tiny_train_env.target)
    assert second.finished and second.start_step == first.step
    rows = [json.loads(line) for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20 and rows[-1]["train_seconds"] >= clock[str(first.step)]
    assert all({"accuracy_first", "train_seconds"} <= set(r) for r in rows)


def test_draft_vocab_table_fills_with_low_ids_and_reports_heldout_coverage(tmp_path):
    from types import SimpleNamespace

    from adaflash_jax.training.drafter_init import draft_vocab_table

    target = SimpleNamespace(cfg=SimpleNamespace(vocab_size=50), eos_token_ids=(2,))
    rows = lambda toks: SimpleNamespace(tokens=np.asarray([[7] + toks]), prompt_lens=np.asarray([1]),  # noqa: E731
                                        seq_lens=np.asarray([1 + len(toks)]))
    d2t, info = draft_vocab_table(6, target, rows([40, 40, 41, 30]), str(tmp_path),
                                  heldout=rows([40, 41, 45, 45]))
    # seen ids (30, 40, 41) and the always-kept end token (2), then the lowest unseen ids (0, 1)
    assert d2t.tolist() == [0, 1, 2, 30, 40, 41]
    assert info["draft_vocab_coverage"] == 1.0 and info["draft_vocab_heldout_coverage"] == 0.5
    again, _ = draft_vocab_table(6, target, rows([45, 45, 45]), str(tmp_path))  # a resumed run keeps it
    assert again.tolist() == d2t.tolist()


def test_init_from_a_saved_drafter_continues_from_its_weights_and_table(tiny_train_env, tmp_path):
    first = trainer.train(tiny_train_env.config(tmp_path / "a", "drafter.draft_vocab_size=48",
                                                "optim.total_steps=60", "eval_every=60"),
                          target=tiny_train_env.target)
    saved = af.load_drafter(first.drafter_dir, target=tiny_train_env.target)
    cont = tiny_train_env.config(tmp_path / "b", "drafter.draft_vocab_size=48", "optim.total_steps=10",
                                 "eval_every=10", f"drafter.init_from={first.drafter_dir}")
    second = trainer.train(cont, target=tiny_train_env.target, stop_at=0)
    assert np.array_equal(np.load(tmp_path / "b" / "d2t.npy"), np.asarray(saved.module.d2t[...]))
    # its held-out τ and accuracy start where the saved drafter ended, not at a random drafter's
    for key in ("tau_teacher_forced", "accuracy_first"):
        assert second.evals[0][key] == pytest.approx(first.evals[-1][key], abs=1e-5), key
    other = tiny_train_env.config(tmp_path / "c", "drafter.draft_vocab_size=64",
                                  f"drafter.init_from={first.drafter_dir}")
    with pytest.raises(ValueError, match="draft_vocab_size: config 64, saved 48"):
        trainer.train(other, target=tiny_train_env.target)
    with pytest.raises(ValueError, match="set one"):
        tiny_train_env.config(tmp_path / "d", f"drafter.init_from={first.drafter_dir}",
                              "drafter.init_from_target=true")

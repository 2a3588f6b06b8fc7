"""The training loop on the tiny experiment: learning, exact resume, sharding, NaN stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
from adaflash_jax.training.orbax_io import CheckpointStore
from adaflash_jax.training import trainer


def test_tiny_run_raises_teacher_forced_tau(tiny_train_env, tmp_path):
    cfg = tiny_train_env.config(tmp_path, "optim.total_steps=200", "eval_every=100")
    result = trainer.train(cfg, target=tiny_train_env.target)
    taus = [e["tau_teacher_forced"] for e in result.evals]
    assert [e["step"] for e in result.evals] == [0, 100, 200]
    assert taus[-1] > taus[0] + 0.5, taus  # random init accepts ~nothing: tau ~ 1
    losses = [result.losses[s] for s in range(200)]
    assert np.mean(losses[-20:]) < np.mean(losses[:20]) - 0.3
    assert result.finished and not result.preempted and result.step == 200
    # The exported drafter (HF layout) drafts exactly what the trained one does.
    loaded = af.load_drafter(result.drafter_dir, target=tiny_train_env.target)
    ids = tiny_train_env.arrays["tokens"][:2, :20]
    np.testing.assert_array_equal(af.draft_logits(tiny_train_env.target, loaded, ids),
                                  af.draft_logits(tiny_train_env.target, result.drafter, ids))
    assert CheckpointStore(str(tmp_path / "checkpoints")).all_steps() == [100, 200]  # every 100
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 1000


def test_resume_continues_the_loss_curve_exactly(tiny_train_env, tmp_path):
    common = ("optim.total_steps=24", "checkpoint.every_steps=8", "data.eval_sequences=0")
    straight = trainer.train(tiny_train_env.config(tmp_path / "a", *common), target=tiny_train_env.target)
    cfg = tiny_train_env.config(tmp_path / "b", *common)
    first = trainer.train(cfg, target=tiny_train_env.target, stop_at=12)
    assert first.step == 12 and not first.finished
    second = trainer.train(cfg, target=tiny_train_env.target)
    assert second.start_step == 12 and second.finished
    assert sorted(first.losses) == list(range(12)) and sorted(second.losses) == list(range(12, 24))
    for s in range(24):
        got = (first.losses if s < 12 else second.losses)[s]
        assert abs(got - straight.losses[s]) <= 1e-6, (s, got, straight.losses[s])
    for a, b in zip(jax.tree.leaves(straight.drafter.state), jax.tree.leaves(second.drafter.state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mesh", [("2", "4", "1"), ("2", "1", "4")], ids=["data2-fsdp4", "data2-tensor4"])
def test_sharded_training_matches_single_device(tiny_train_env, tmp_path, mesh):
    common = ("optim.total_steps=4", "data.eval_sequences=0", "data.batch_size=8")
    single = trainer.train(tiny_train_env.config(tmp_path / "one", *common), target=tiny_train_env.target)
    axes = [f"mesh.{k}={v}" for k, v in zip(("data", "fsdp", "tensor"), mesh)]
    sharded = trainer.train(tiny_train_env.config(tmp_path / "many", *common, *axes),
                            target=tiny_train_env.target)
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(sharded.drafter.state)}
    axis = "fsdp" if mesh[1] != "1" else "tensor"
    assert any(axis in s for s in specs), specs  # weights really are split over the mesh
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(sharded.drafter.state))
    for s in range(4):
        assert abs(single.losses[s] - sharded.losses[s]) <= 1e-5, (s, single.losses[s], sharded.losses[s])
    for a, b in zip(jax.tree.leaves(single.drafter.state), jax.tree.leaves(sharded.drafter.state)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_train_env, tmp_path, monkeypatch):
    common = ("optim.total_steps=20", "checkpoint.every_steps=5", "data.eval_sequences=0")
    reference = trainer.train(tiny_train_env.config(tmp_path / "ref", *common), target=tiny_train_env.target)
    real_step = trainer.train_step
    seen = []

    def poisoned(*args, **kwargs):  # step 7 produces NaN parameters and a NaN loss
        params, opt, metrics = real_step(*args, **kwargs)
        seen.append(len(seen))
        if len(seen) - 1 == 7:
            params = jax.tree.map(lambda x: x * jnp.nan, params)
            metrics = dict(metrics, loss=metrics["loss"] * jnp.nan)
        return params, opt, metrics

    cfg = tiny_train_env.config(tmp_path / "run", *common)
    monkeypatch.setattr(trainer, "train_step", poisoned)
    with pytest.raises(FloatingPointError, match=r"non-finite training loss at step 7.*Last good "
                                                 r"checkpoint: step 5"):
        trainer.train(cfg, target=tiny_train_env.target)
    assert CheckpointStore(str(tmp_path / "run" / "checkpoints")).all_steps() == [5]
    monkeypatch.setattr(trainer, "train_step", real_step)
    resumed = trainer.train(cfg, target=tiny_train_env.target)
    assert resumed.start_step == 5 and resumed.finished
    for s in range(5, 20):
        assert abs(resumed.losses[s] - reference.losses[s]) <= 1e-6, s
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.to_pure_dict(
        resumed.drafter.state)))


def test_cached_features_train_like_on_the_fly_ones(tiny_train_env, tmp_path):
    common = ("optim.total_steps=6", "data.eval_sequences=4")
    live = trainer.train(tiny_train_env.config(tmp_path / "live", *common), target=tiny_train_env.target)
    cfg = tiny_train_env.config(tmp_path / "cached", *common, "data.cache_features=true")
    cached = trainer.train(cfg, target=tiny_train_env.target)
    for s in range(6):
        assert abs(live.losses[s] - cached.losses[s]) <= 1e-5, (s, live.losses[s], cached.losses[s])
    assert abs(live.evals[-1]["tau_teacher_forced"] - cached.evals[-1]["tau_teacher_forced"]) < 1e-6
    feats = tmp_path / "cached" / "features" / "features.npy"
    assert feats.exists()
    stamp = feats.stat().st_mtime_ns
    again = trainer.train(cfg, target=tiny_train_env.target, resume=False, overwrite=True)
    assert feats.stat().st_mtime_ns == stamp  # read back, not recomputed
    assert again.losses == cached.losses
    # A cache computed from other data is refused, and left as it is.
    fewer = tmp_path / "fewer.npz"
    np.savez(fewer, **{k: v[:100] for k, v in tiny_train_env.arrays.items()})
    other = tiny_train_env.config(tmp_path / "cached", *common, "data.cache_features=true",
                                  f"data.path={fewer}")
    with pytest.raises(ValueError, match="feature cache .* other data"):
        trainer.train(other, target=tiny_train_env.target, resume=False, overwrite=True)
    assert feats.stat().st_mtime_ns == stamp

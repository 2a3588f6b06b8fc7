"""The on-policy distillation loop on the tiny experiment: rounds (greedy and sampled), stages,
exact resume, export, and a drafter with a reduced draft vocabulary."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
from adaflash_jax.models.length_head import LengthHead
from adaflash_jax.training import rollouts, trainer
from adaflash_jax.training.config import load_config, override
from adaflash_jax.training.opd import train_opd
from adaflash_jax.training.opd_buffer import RolloutBuffer
from adaflash_jax.models.draft_vocab import frequent_tokens
from adaflash_jax.training import anchors as blocks
from adaflash_jax.training.opd_loss import opd_loss
from adaflash_jax.training.opd_step import OPDHyper, drafter_terms, head_terms, lm_head_matrix
from adaflash_jax.training.step import block_hidden, label_validity

TOTAL, STAGE1, ROUND, PER_ROUND = 12, 4, 4, 8  # configs/tiny_opd.py


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = load_config("tiny_opd")
    target = trainer.build_target(base, trainer.build_mesh(base))
    root = tmp_path_factory.mktemp("opd")

    def config(name, *overrides):
        return override(base, ["progress=false", f"checkpoint.dir={root / name}", *overrides])

    straight = train_opd(config("straight"), target=target)
    return base, target, config, straight, root


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(state))]


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))


def test_rounds_grow_the_buffer_and_the_export_carries_the_head(env):
    base, target, _, r, root = env
    assert r.finished and r.step == TOTAL and sorted(r.losses) == list(range(TOTAL))
    assert [(x["round"], x["step"], x["shard"]) for x in r.rollouts] == [(0, 0, 0), (1, 4, 1), (2, 8, 2)]
    assert [x["rows"] for x in r.rollouts] == [PER_ROUND] * 3 and r.buffer_rows == 3 * PER_ROUND
    # τ of the speculative engine's rounds: a real mean of commits per verify step
    bs = base.drafter.block_size
    assert all(1.0 <= x["tau"] <= bs for x in r.rollouts), [x["tau"] for x in r.rollouts]
    assert all(x["temperature"] == 0.0 for x in r.rollouts)  # greedy by default
    assert rollouts.completed_shards(str(root / "straight" / "buffer")) == [0, 1, 2]
    assert all(np.isfinite(list(r.losses.values()))) and all(np.isfinite(list(r.head_losses.values())))
    loaded = af.load_drafter(r.drafter_dir, target=target)
    assert loaded.has_length_head and r.drafter.has_length_head
    assert _same(loaded.head_state, r.drafter.head_state) and _same(loaded.state, r.drafter.state)
    assert list((root / "straight" / "tensorboard").glob("events.out.tfevents.*"))


def test_stage1_trains_only_the_head_then_stage2_both_and_resume_is_exact(env):
    base, target, config, straight, _ = env
    cfg = config("resumed")
    init = trainer.build_drafter(cfg, target)
    init_head = nnx.state(LengthHead(init.cfg.hidden_size, cfg.opd.head_bottleneck, rngs=nnx.Rngs(cfg.seed)))
    first = train_opd(cfg, target=target, stop_at=STAGE1)  # the whole of stage 1
    assert first.step == STAGE1 and not first.finished
    assert _same(first.drafter.state, init.state)  # frozen drafter
    assert not _same(first.drafter.head_state, init_head)  # the head trained
    second = train_opd(cfg, target=target, stop_at=STAGE1 + 2)  # resumes, stops mid-round
    assert second.start_step == STAGE1 and second.rollouts[0]["round"] == 1
    assert not _same(second.drafter.state, first.drafter.state)
    assert not _same(second.drafter.head_state, first.drafter.head_state)
    third = train_opd(cfg, target=target)
    assert third.start_step == STAGE1 + 2 and third.finished
    assert [x["round"] for x in third.rollouts] == [2]
    for s in range(TOTAL):
        run = first if s < STAGE1 else second if s < STAGE1 + 2 else third
        assert abs(run.losses[s] - straight.losses[s]) <= 1e-6, (s, run.losses[s], straight.losses[s])
        assert abs(run.head_losses[s] - straight.head_losses[s]) <= 1e-6, s
    for a, b in zip(_leaves(straight.drafter.head_state), _leaves(third.drafter.head_state)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # A finished run refuses to start over unless told to discard its checkpoints and buffer.
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        train_opd(cfg, target=target, resume=False)


def test_no_gradient_from_the_head_loss_reaches_the_drafter(env):
    base, target, config, straight, root = env
    drafter = straight.drafter
    graphdef, params, rest = nnx.split(drafter.module, nnx.Param, ...)
    head_def, head_params = nnx.split(drafter.length_head, nnx.Param)
    buf = RolloutBuffer(str(root / "straight" / "buffer"), target, drafter.cfg.target_layer_ids,
                        base.data.seq_len, {})
    buf.activate(0, progress=False)
    batch = jax.tree.map(jax.numpy.asarray, buf.batch(0, 4, 0))
    hp = OPDHyper(base.data.num_blocks, base.gamma, 0.8, 1.0, 0.01, "mean")
    tmodule = nnx.merge(target.graphdef, target.state)

    def head_loss_of_drafter(p):
        _, (_, hidden, drafts, labels, valid, conf) = drafter_terms(p, tmodule, graphdef, rest, batch,
                                                                    jax.random.key(0), hp)
        return head_terms(head_params, head_def, hidden, drafts, labels, valid, conf)[0]

    loss, grads = jax.jit(jax.value_and_grad(head_loss_of_drafter))(params)
    assert float(loss) > 0
    assert all(float(np.abs(g).max()) == 0.0 for g in _leaves(grads))


def test_seed_store_fills_the_buffer_first_and_its_prompts_are_skipped(env, tmp_path):
    base, target, config, _, _ = env
    from adaflash_jax.training.opd import prompt_pool

    pool, _ = prompt_pool(base, target)
    seed_dir = str(tmp_path / "seed")
    rollouts.generate_rollouts(target, pool[:5], ["random"] * 5, seed_dir, max_new_tokens=24,
                               batch_size=8, progress=False)
    cfg = config("seeded", f"opd.seed_rollouts={seed_dir}", "opd.seed_max_rows=3", "optim.total_steps=2",
                 "opd.head_stage1_steps=1")
    r = train_opd(cfg, target=target)
    assert r.finished and r.rollouts[0]["shard"] == 1 and r.buffer_rows == 3 + PER_ROUND
    buffer_dir = os.path.join(cfg.checkpoint.dir, "buffer")
    seeded = [rec["prompt_ids"] for rec in rollouts.read_shard(buffer_dir, 0)]
    assert seeded == [list(p) for p in pool[:3]]
    fresh = [rec["prompt_ids"] for rec in rollouts.read_shard(buffer_dir, 1)]
    assert fresh == [list(p) for p in pool[3:3 + PER_ROUND]]  # the seeded prompts are not redone


def test_sampled_rounds_write_rows_and_greedy_rounds_are_unchanged(env):
    """Rounds cycle through opd.rollout_temperatures: here greedy, T = 0.8, greedy. The greedy
    rounds hold the target's greedy trajectories exactly as an all-greedy run's (the drafters
    differ, the engine is lossless); the sampled round holds one sampled response per prompt."""
    base, target, config, straight, root = env
    cfg = config("sampled", "opd.rollout_temperatures=0,0.8", "opd.rollout_top_p=0.9")
    r = train_opd(cfg, target=target)
    assert r.finished and [x["temperature"] for x in r.rollouts] == [0.0, 0.8, 0.0]
    assert [x["rows"] for x in r.rollouts] == [PER_ROUND] * 3
    assert all(1.0 <= x["tau"] <= base.drafter.block_size for x in r.rollouts)
    mine, ref = os.path.join(cfg.checkpoint.dir, "buffer"), str(root / "straight" / "buffer")
    for shard in (0, 2):
        assert rollouts.read_shard(mine, shard) == rollouts.read_shard(ref, shard)
    sampled, greedy = rollouts.read_shard(mine, 1), rollouts.read_shard(ref, 1)
    assert [x["prompt_ids"] for x in sampled] == [x["prompt_ids"] for x in greedy]
    assert all(x["sample"] == 1 for x in sampled)
    assert [x["response_ids"] for x in sampled] != [x["response_ids"] for x in greedy]
    assert all(np.isfinite(list(r.losses.values())))
    # The buffer remembers its decoding settings: resuming with others is refused.
    with pytest.raises(ValueError, match="different settings"):
        train_opd(override(cfg, ["opd.rollout_temperatures=0"]), target=target)


def test_reduced_draft_vocabulary_drafter_is_distilled_over_its_tokens(env):
    """drafter_terms on a drafter predicting over K target tokens: its loss is opd_loss with d2t
    on the block states and the target's teacher states, and its drafts are target ids in d2t."""
    base, target, config, straight, root = env
    buf = RolloutBuffer(str(root / "straight" / "buffer"), target, straight.drafter.cfg.target_layer_ids,
                        base.data.seq_len, {})
    buf.activate(0, progress=False)
    batch = jax.tree.map(jax.numpy.asarray, buf.batch(0, 4, 0))
    d2t = frequent_tokens(np.asarray(batch.tokens), target.cfg.vocab_size, target.cfg.vocab_size // 3)
    reduced = straight.drafter.with_draft_vocab(d2t)
    graphdef, params, rest = nnx.split(reduced.module, nnx.Param, ...)
    hp = OPDHyper(base.data.num_blocks, base.gamma, 0.5, 1.0, None, "position")
    tmodule = nnx.merge(target.graphdef, target.state)
    key = jax.random.key(3)
    loss, (m, hidden, drafts, labels, valid, conf) = drafter_terms(params, tmodule, graphdef, rest, batch, key,
                                                                   hp)

    module = nnx.merge(graphdef, params, rest)
    b, t = batch.tokens.shape
    anchors, anchor_ok = blocks.sample_anchors(key, batch.prompt_lens, batch.seq_lens, seq_len=t,
                                               num_blocks=hp.num_blocks)
    h_s, _, label_pos = block_hidden(tmodule, module, batch, anchors)
    src = np.clip(np.asarray(label_pos) - 1, 0, t - 1).reshape(b, -1)
    h_t = np.take_along_axis(np.asarray(batch.teacher), src[..., None], axis=1)
    w = (blocks.position_weights(module.cfg.block_size, hp.gamma)
         * label_validity(label_pos, batch.seq_lens, anchor_ok)).reshape(-1)
    dt = tmodule.cfg.compute_dtype
    want, _ = opd_loss(h_s.reshape(-1, h_s.shape[-1]).astype(dt), jax.numpy.asarray(h_t).reshape(
        -1, h_s.shape[-1]).astype(dt), lm_head_matrix(tmodule), w, d2t=jax.numpy.asarray(d2t), alpha=0.5)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert labels.shape == drafts.shape and float(m["reverse_kl"]) > 0
    z = np.asarray(h_s.reshape(-1, h_s.shape[-1]).astype(dt), np.float32) @ np.asarray(
        lm_head_matrix(tmodule), np.float32)[:, d2t]
    assert np.array_equal(np.asarray(drafts).reshape(-1), d2t[z.argmax(-1)])  # K-way argmax, as ids
    # The head's labels compare those target ids with the trajectory's: a finite, trainable loss.
    head_def, head_params = nnx.split(straight.drafter.length_head, nnx.Param)
    head_loss, (_, targets, _) = head_terms(head_params, head_def, hidden, drafts, labels, valid, conf)
    assert np.isfinite(float(head_loss)) and float(np.max(targets)) > 1.0 / labels.shape[-1]
    # The confidence input is each draft's probability: the max of the K-way softmax.
    p = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(conf).reshape(-1), (p.max(-1) / p.sum(-1)).reshape(
        conf.shape[0], -1)[:, 1:].reshape(-1), rtol=1e-4)


@pytest.mark.parametrize("item, message", [
    ("opd.alpha=1.5", r"opd.alpha must lie in \[0, 1\]"),
    ("opd.clip_mode=max", "opd.clip_mode must be one of"),
    ("opd.refresh_every=0", "opd.refresh_every must be positive"),
    ("opd.head_stage1_steps=-1", "opd.head_stage1_steps must be >= 0"),
    ("opd.kl_clip=0", "opd.kl_clip must be positive or None"),
    ("opd.clip_mode=token", "opd.clip_mode must be one of"),
    ("opd.rollout_temperatures=0,-1", "opd.rollout_temperatures must list"),
    ("opd.rollout_top_p=0", r"opd.rollout_top_p must lie in \(0, 1\]"),
    ("opd.nosuch=1", "unknown config key 'opd.nosuch'"),
])
def test_bad_opd_values_are_refused(item, message):
    with pytest.raises(ValueError, match=message):
        override(load_config("tiny_opd"), [item])


def test_bad_run_settings_fail_before_any_work(env, tmp_path):
    base, target, config, _, _ = env
    with pytest.raises(ValueError, match=r"head_stage1_steps \(13\) must be at most optim.total_steps"):
        train_opd(config("bad1", "opd.head_stage1_steps=13"), target=target)
    with pytest.raises(ValueError, match="seed_rollouts=.* is not a directory"):
        train_opd(config("bad2", f"opd.seed_rollouts={tmp_path / 'missing'}"), target=target)


def test_head_only_run_trains_a_confidence_head_and_decoding_with_it_stays_lossless(env):
    """opd.head_confidence on a drafter whose head lacks that input: a fresh head that reads the
    drafts' probabilities; head_stage1_steps == total_steps never changes the drafter. The head
    saves and loads with its extra tensor, and every length policy decodes exactly as AR does."""
    base, target, config, straight, _ = env
    r = train_opd(config("head_only", f"opd.init_drafter={straight.drafter_dir}", "opd.head_confidence=true",
                         "optim.total_steps=3", "opd.head_stage1_steps=3"), target=target)
    assert r.finished and all(np.isfinite(list(r.head_losses.values())))
    loaded = af.load_drafter(r.drafter_dir, target=target)
    head = loaded.length_head
    assert head.uses_confidence and head.confidence_width == base.drafter.block_size - 1
    assert _same(loaded.state, straight.drafter.state)  # the drafter itself never moved
    assert _same(loaded.head_state, r.drafter.head_state)
    prompts = [[5, 9, 14, 3, 7], [11, 2, 8]]
    want = af.generate(target, prompts, max_new_tokens=20).token_ids
    for policy in ("head", "auto"):
        got = af.generate(target, prompts, max_new_tokens=20, drafter=loaded, length_policy=policy)
        assert got.token_ids == want, policy
    sampled = dict(max_new_tokens=20, temperature=0.8, seed=3)
    want = af.generate(target, prompts, **sampled).token_ids
    assert af.generate(target, prompts, drafter=loaded, length_policy="auto", **sampled).token_ids == want
    # sampled drafts: the head reads each sampled draft's probability
    got = af.generate(target, prompts, drafter=loaded, length_policy="head", sample_drafts=True, **sampled)
    assert [len(t) for t in got.token_ids] == [20, 20]
    with pytest.raises(ValueError, match="needs the drafts' confidence"):
        head(jax.numpy.zeros((1, base.drafter.block_size, target.cfg.hidden_size)))

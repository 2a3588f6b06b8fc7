"""Shared tiny target, drafters and a small distillation loop for the speculative tests.

Everything is cached per process, so the test files share one target, one
distilled drafter and the same compiled shapes (batch 4, prompt bucket 16,
max_new cap 64). All drafters have the same parameter shapes (2 layers on the
6-layer TINY target), because eager random init compiles once per shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import adaflash_jax as af
from adaflash_jax.checkpoints import hf
from adaflash_jax.drafter_api import Drafter
from adaflash_jax.models.config import ModelConfig
from adaflash_jax.models.drafter import draft_block
from adaflash_jax.models.kv_cache import KVCache
from adaflash_jax.models.target import TargetLM
from adaflash_jax.target_api import target_from_params

# q/o projections (4 heads x 16) are wider than the hidden size (32) on purpose.
TINY = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=512)
BLOCK = 16
# Prompts of different lengths inside one prompt bucket (16); they are part of the
# distillation set, so the distilled drafter knows their trajectories.
TEST_PROMPTS = [[5, 17, 3], [9, 1, 22, 30, 4, 12], [2, 2, 8, 19, 27, 6, 11, 0, 14, 25],
                [7, 28, 13, 3, 3, 21, 16, 9, 10, 1, 29, 18, 24, 4]]


@functools.lru_cache(maxsize=None)
def tiny_target() -> af.Target:
    return af.random_target(TINY, seed=0)


@pytest.fixture(scope="module")
def target():
    """The TINY random target (import this fixture into a test module to use it)."""
    return tiny_target()


@pytest.fixture(scope="module")
def drafter():
    """The drafter distilled on the TINY target's greedy trajectories."""
    return distilled_drafter()


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 15) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, size=int(k)).tolist() for k in rng.integers(lo, hi, size=n)]


def greedy_rows(target, prompts, max_new: int) -> list[list[int]]:
    """prompt + greedy continuation (no stop ids), in batches of 4 (the tests' shape)."""
    rows = []
    for i in range(0, len(prompts), 4):
        chunk = prompts[i:i + 4]
        res = af.generate(target, chunk, max_new_tokens=max_new, stop_token_ids=())
        rows += [p + o for p, o in zip(chunk, res.token_ids)]
    return rows


@functools.partial(jax.jit, static_argnames=("target_def", "layer_ids"))
def _features(target_def, tstate, seqs, layer_ids):
    return nnx.merge(target_def, tstate)(seqs, feature_layers=layer_ids).features


def block_loss(target_module, drafter_def, dstate, feats, seqs, rows, anchors):
    """Weighted CE of block offsets 1..B-1 against the target's own tokens.

    The context cache holds the whole sequence's K/V; committing it to
    `anchors` hides everything from the anchor on, exactly as at inference.
    """
    drafter = nnx.merge(drafter_def, dstate)
    n, t = rows.shape[0], seqs.shape[1]
    bs = drafter.cfg.block_size
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (n, t))
    k, v = drafter.context_kv(feats[rows], positions)  # slot j = position j: the cache layout
    hidden = draft_block(drafter, target_module.embed_tokens, seqs[rows, anchors],
                         KVCache(k=k, v=v, lengths=anchors))[:, 1:]
    logp = jax.nn.log_softmax(target_module.logits(hidden), axis=-1)  # [n, bs-1, V]
    idx = anchors[:, None] + jnp.arange(1, bs)[None]
    labels = seqs[rows[:, None], jnp.minimum(idx, t - 1)]
    weight = (idx < t) * jnp.exp(-jnp.arange(bs - 1) / 7.0)[None]
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(weight * nll) / jnp.sum(weight)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "steps", "batch", "lr"))
def _train(target_def, drafter_def, tstate, dstate, feats, seqs, key, *, steps, batch, lr):
    module = nnx.merge(target_def, tstate)
    opt = optax.adam(lr)

    def step(carry, key):
        dstate, opt_state = carry
        k1, k2 = jax.random.split(key)
        rows = jax.random.randint(k1, (batch,), 0, seqs.shape[0])
        anchors = jax.random.randint(k2, (batch,), 1, seqs.shape[1] - 1)
        loss, grads = jax.value_and_grad(lambda s: block_loss(
            module, drafter_def, s, feats, seqs, rows, anchors))(dstate)
        updates, opt_state = opt.update(grads, opt_state, dstate)
        return (optax.apply_updates(dstate, updates), opt_state), loss

    (dstate, _), losses = jax.lax.scan(step, (dstate, opt.init(dstate)), jax.random.split(key, steps))
    return dstate, losses[-1]


def distill(target, drafter: Drafter, seqs: np.ndarray, *, steps: int, lr: float = 1e-2,
            batch: int = 32, seed: int = 0) -> tuple[Drafter, float]:
    """Adam on block CE at random anchors of the target's greedy sequences [N, T]."""
    seqs_j = jnp.asarray(seqs, jnp.int32)
    feats = _features(target.graphdef, target.state, seqs_j, drafter.cfg.target_layer_ids)
    dstate, loss = _train(target.graphdef, drafter.graphdef, target.state, drafter.state, feats,
                          seqs_j, jax.random.key(seed), steps=steps, batch=batch, lr=lr)
    return Drafter(drafter.cfg, drafter.graphdef, dstate, drafter.name + "-distilled"), float(loss)


@functools.lru_cache(maxsize=None)
def distilled_drafter(steps: int = 300) -> Drafter:
    """A BLOCK-16 drafter that has learnt the tiny target's greedy trajectories."""
    target = tiny_target()
    rows = greedy_rows(target, TEST_PROMPTS + random_prompts(4, seed=1), max_new=64)
    t = min(len(r) for r in rows)
    seqs = np.asarray([r[:t] for r in rows], np.int32)
    drafter = af.init_drafter(target, num_layers=2, block_size=BLOCK, seed=0)
    return distill(target, drafter, seqs, steps=steps)[0]


@functools.lru_cache(maxsize=None)
def reduced_vocab_drafter(k: int = 20) -> Drafter:
    """The distilled drafter restricted to the `k` most frequent tokens of the test prompts'
    greedy trajectories (a reduced draft vocabulary: some target tokens can never be drafted)."""
    from adaflash_jax.models.draft_vocab import frequent_tokens

    rows = greedy_rows(tiny_target(), TEST_PROMPTS, max_new=64)
    return distilled_drafter().with_draft_vocab(frequent_tokens(rows, TINY.vocab_size, k))


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def numpy_target(seed: int = 0, **changes) -> af.Target:
    """A Target with TINY's config (plus `changes`) and host-random weights.

    Built without eager random init (which compiles per shape), for tests that
    need a second, differently shaped target only briefly.
    """
    cfg = TINY.replace(**changes)
    rng = np.random.default_rng(seed)
    params: dict = {}
    for path, shape in hf.expected_shapes(lambda: TargetLM(cfg, rngs=nnx.Rngs(0))).items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return target_from_params(cfg, params, name="numpy-random")

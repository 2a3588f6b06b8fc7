"""The jitted DFlash training step (offline: target features on the fly, or cached).

Pure functions of (graph definitions, drafter parameter state, optimizer
state, batch): the frozen target computes features and is never
differentiated; the drafter sees every block of every sequence in one pass.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from adaflash_jax.models import draft_vocab
from adaflash_jax.training import anchors as blocks
from adaflash_jax.training.losses import acceptance_metrics, decayed_cross_entropy


class Batch(NamedTuple):
    tokens: jax.Array  # int32 [B, T] prompt + response, right-padded
    prompt_lens: jax.Array  # int32 [B]
    seq_lens: jax.Array  # int32 [B] (prompt + response)
    features: jax.Array | None = None  # [B, T, k*D] cached target features; None: computed per step


def make_optimizer(lr: float, total_steps: int, warmup_frac: float = 0.04, clip: float = 1.0,
                   weight_decay: float = 0.01) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay, after global-norm clipping."""
    warmup = max(1, int(round(total_steps * warmup_frac)))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1))
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, weight_decay=weight_decay))


def block_hidden(target, drafter, batch: Batch, anchors: jax.Array, attn_impl: str = "xla"):
    """Drafter final-norm hidden states [B, N*Bs, D] for blocks at `anchors`, plus labels and
    label positions [B, N, Bs]. `batch` is any batch with tokens and (optional) features."""
    cfg = drafter.cfg
    b, t = batch.tokens.shape
    if batch.features is None:
        feats = target(batch.tokens, feature_layers=cfg.target_layer_ids, attn_impl=attn_impl).features
    else:
        feats = batch.features.astype(target.cfg.compute_dtype)
    feats = jax.lax.stop_gradient(feats)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    ctx_k, ctx_v = drafter.context_kv(feats, positions)
    tokens, pos, labels, label_pos = blocks.block_inputs(
        batch.tokens, anchors, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id)
    mask = blocks.block_attention_mask(anchors, seq_len=t, block_size=cfg.block_size)
    embeds = jax.lax.stop_gradient(target.embed_tokens(tokens))
    return (drafter(embeds, pos, ctx_k, ctx_v, mask, attn_impl=attn_impl, anchors=anchors),
            labels, label_pos)


def block_logits(target, drafter, batch: Batch, anchors: jax.Array, attn_impl: str = "xla"):
    """Drafter logits [B, N, Bs, K] over its draft vocabulary (K = V unless reduced) for blocks
    at `anchors`, labels [B, N, Bs] as draft-vocabulary indices (-1: outside it), and their
    positions."""
    hidden, labels, label_pos = block_hidden(target, drafter, batch, anchors, attn_impl)
    logits = draft_vocab.logits(target, drafter, hidden).reshape(*labels.shape, -1)
    return logits, draft_vocab.to_draft(drafter, labels), label_pos


def label_validity(label_pos, seq_lens, anchor_valid):
    return (label_pos < seq_lens[:, None, None]) & anchor_valid[..., None]


def dflash_loss(params, target, drafter_def, rest, batch: Batch, key, *, num_blocks: int,
                gamma: float, attn_impl: str = "xla"):
    drafter = nnx.merge(drafter_def, params, rest)
    anchors, anchor_valid = blocks.sample_anchors(
        key, batch.prompt_lens, batch.seq_lens, seq_len=batch.tokens.shape[1], num_blocks=num_blocks)
    logits, labels, label_pos = block_logits(target, drafter, batch, anchors, attn_impl)
    valid = label_validity(label_pos, batch.seq_lens, anchor_valid)
    weights = blocks.position_weights(drafter.cfg.block_size, gamma)
    # A label outside a reduced draft vocabulary cannot be predicted: no loss, but a miss for τ.
    loss, _ = decayed_cross_entropy(logits, jnp.maximum(labels, 0), valid & (labels >= 0), weights)
    return loss, acceptance_metrics(logits, labels, valid)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "tx", "num_blocks",
                                             "gamma", "attn_impl"), donate_argnames=("params", "opt_state"))
def train_step(target_def, drafter_def, tx, tstate, params, rest, opt_state, batch: Batch, key, *,
               num_blocks: int, gamma: float, attn_impl: str = "xla"):
    """One optimizer step. Returns (params, opt_state, metrics)."""
    target = nnx.merge(target_def, tstate)
    grad_fn = jax.value_and_grad(dflash_loss, has_aux=True)
    (loss, metrics), grads = grad_fn(params, target, drafter_def, rest, batch, key,
                                     num_blocks=num_blocks, gamma=gamma, attn_impl=attn_impl)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
    return params, opt_state, metrics


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "num_blocks"))
def eval_step(target_def, drafter_def, tstate, params, rest, batch: Batch, key, *, num_blocks: int):
    """Teacher-forced metrics on a held-out batch (no update)."""
    target = nnx.merge(target_def, tstate)
    drafter = nnx.merge(drafter_def, params, rest)
    anchors, anchor_valid = blocks.sample_anchors(
        key, batch.prompt_lens, batch.seq_lens, seq_len=batch.tokens.shape[1], num_blocks=num_blocks)
    logits, labels, label_pos = block_logits(target, drafter, batch, anchors)
    return acceptance_metrics(logits, labels, label_validity(label_pos, batch.seq_lens, anchor_valid))

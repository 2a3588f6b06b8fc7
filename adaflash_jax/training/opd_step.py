"""The jitted on-policy distillation step: OPD loss for the drafter, MSE for the length head.

One pass of the drafter over all sampled blocks gives its final-norm hidden
states; the OPD loss (`opd_loss`) compares them, through the shared LM head, with
the target's last-layer hidden states one position earlier (cached beside the
buffer rows); a drafter with a reduced draft vocabulary is distilled over its K
tokens against the full teacher. The same pass gives the drafter's block argmax, hence the
teacher-forced greedy acceptance a of every block and its label s = (a+1)/Bs;
the length head regresses s from the detached block hidden states with its own
optimizer. The head loss is differentiated with respect to the head's
parameters only and its input is stopped, so no gradient reaches the drafter.
Stage 1 (`train_drafter=False`) evaluates the drafter without updating it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from adaflash_jax.models import draft_vocab
from adaflash_jax.models.length_head import accepted_counts, length_labels, length_loss
from adaflash_jax.training import anchors as blocks
from adaflash_jax.training.opd_loss import opd_loss
from adaflash_jax.training.step import block_hidden, label_validity


# Logit elements (tokens × vocab) above which the OPD loss recomputes its LM-head products in
# the backward pass instead of keeping them (64M f32 = 256 MiB per kept [N, V] operand).
REMAT_ABOVE = 2**26


class OPDBatch(NamedTuple):
    tokens: jax.Array  # int32 [B, T] prompt + response, right-padded
    prompt_lens: jax.Array  # int32 [B]
    seq_lens: jax.Array  # int32 [B]
    features: jax.Array  # [B, T, k*D] target features at the drafter's layers
    teacher: jax.Array  # [B, T, D] target final-norm hidden states (the OPD teacher)


class OPDHyper(NamedTuple):
    """Static settings of the step (hashable: a jit static argument)."""

    num_blocks: int
    gamma: float
    alpha: float
    temperature: float
    clip: float | None  # τ, None = no clamp
    clip_mode: str
    attn_impl: str = "xla"


def lm_head_matrix(target) -> jax.Array:
    """The target's output projection as [D, V] in its compute dtype (tied or not)."""
    w, layout = target.head_weight()
    w = w.astype(target.cfg.compute_dtype)
    return w.T if layout == "vd" else w


def drafter_terms(params, target, drafter_def, rest, batch: OPDBatch, key, hp: OPDHyper):
    """(OPD loss, aux) for the blocks sampled with `key`; aux carries what the head needs.

    A drafter with a reduced draft vocabulary is distilled over its K tokens (see `opd_loss`);
    its drafts in aux are target ids either way, so the head's labels compare like with like."""
    drafter = nnx.merge(drafter_def, params, rest)
    b, t = batch.tokens.shape
    bs = drafter.cfg.block_size
    anchors, anchor_valid = blocks.sample_anchors(key, batch.prompt_lens, batch.seq_lens, seq_len=t,
                                                  num_blocks=hp.num_blocks)
    hidden, labels, label_pos = block_hidden(target, drafter, batch, anchors, hp.attn_impl)
    valid = label_validity(label_pos, batch.seq_lens, anchor_valid)
    # Teacher for label index j = anchor + k is the target's hidden state at j - 1.
    src = jnp.clip(label_pos - 1, 0, t - 1).reshape(b, -1)
    h_t = jnp.take_along_axis(batch.teacher, src[..., None], axis=1)
    weights = blocks.position_weights(bs, hp.gamma) * valid
    d = hidden.shape[-1]
    dt = target.cfg.compute_dtype
    w_head = lm_head_matrix(target)
    remat = hidden.shape[1] * b * w_head.shape[1] > REMAT_ABOVE  # the teacher's [N, V] dominates
    d2t = drafter.d2t[...] if draft_vocab.is_reduced(drafter) else None
    loss, m = opd_loss(hidden.reshape(-1, d).astype(dt), h_t.reshape(-1, d).astype(dt), w_head,
                       weights.reshape(-1), d2t=d2t, alpha=hp.alpha, temperature=hp.temperature,
                       clip=hp.clip, clip_mode=hp.clip_mode, remat=remat)
    drafts = m.pop("student_tokens").reshape(labels.shape)
    confidence = m.pop("student_confidence").reshape(b * hp.num_blocks, bs)[:, 1:]
    return loss, (m, hidden.reshape(b * hp.num_blocks, bs, d), drafts, labels, valid, confidence)


def head_terms(head_params, head_def, block_hidden_states, drafts, labels, valid, confidence):
    """(MSE, (scores, label scores, block weights)) of the length head on blocks [M, Bs, D];
    confidence [M, Bs-1] is the drafts' probabilities (used by a head with that input)."""
    bs = labels.shape[-1]
    targets = length_labels(accepted_counts(drafts, labels, valid), bs).reshape(-1)
    block_w = valid[..., 1].reshape(-1).astype(jnp.float32)  # a block with at least one label
    head = nnx.merge(head_def, head_params)
    scores = head(jax.lax.stop_gradient(block_hidden_states), confidence if head.uses_confidence else None)
    return length_loss(scores, targets, block_w), (scores, targets, block_w)


def weighted_corr(x, y, w):
    """Pearson correlation of x and y under weights w (0 when either is constant)."""
    n = jnp.maximum(jnp.sum(w), 1e-9)
    mx, my = jnp.sum(w * x) / n, jnp.sum(w * y) / n
    cov = jnp.sum(w * (x - mx) * (y - my)) / n
    vx, vy = jnp.sum(w * (x - mx) ** 2) / n, jnp.sum(w * (y - my) ** 2) / n
    return jnp.where((vx > 0) & (vy > 0), cov / jnp.sqrt(jnp.maximum(vx * vy, 1e-30)), 0.0)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "head_def", "tx", "head_tx",
                                             "hp", "train_drafter"),
                   donate_argnames=("params", "opt_state", "head_params", "head_opt"))
def opd_train_step(target_def, drafter_def, head_def, tx, head_tx, tstate, params, rest, opt_state,
                   head_params, head_opt, batch: OPDBatch, key, *, hp: OPDHyper, train_drafter: bool):
    """One step of both optimizers (the drafter's only when `train_drafter`).

    Returns (params, opt_state, head_params, head_opt, metrics)."""
    target = nnx.merge(target_def, tstate)
    args = (target, drafter_def, rest, batch, key, hp)
    if train_drafter:
        (loss, aux), grads = jax.value_and_grad(drafter_terms, has_aux=True)(params, *args)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        gnorm = optax.global_norm(grads)
    else:
        loss, aux = drafter_terms(params, *args)
        gnorm = jnp.float32(0.0)
    m, hidden, drafts, labels, valid, confidence = aux
    (head_loss, (scores, targets, block_w)), hgrads = jax.value_and_grad(head_terms, has_aux=True)(
        head_params, head_def, hidden, drafts, labels, valid, confidence)
    hupdates, head_opt = head_tx.update(hgrads, head_opt, head_params)
    head_params = optax.apply_updates(head_params, hupdates)
    n_blocks = jnp.maximum(jnp.sum(block_w), 1.0)
    metrics = dict(m, loss=loss, grad_norm=gnorm, head_mse=head_loss,
                   head_corr=weighted_corr(scores, targets, block_w),
                   head_score_mean=jnp.sum(block_w * scores) / n_blocks,
                   tau_teacher_forced=jnp.sum(block_w * targets) / n_blocks * labels.shape[-1])
    return params, opt_state, head_params, head_opt, metrics


def make_head_optimizer(stage1_lr: float, lr: float, stage1_steps: int, clip: float = 1.0,
                        weight_decay: float = 0.01) -> optax.GradientTransformation:
    """The length head's AdamW: `stage1_lr` for the first `stage1_steps` updates, then `lr`."""
    schedule = optax.join_schedules([optax.constant_schedule(stage1_lr), optax.constant_schedule(lr)],
                                    [stage1_steps])
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay))

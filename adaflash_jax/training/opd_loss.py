"""The AdaFlash on-policy distillation loss, chunked over tokens so [tokens, V] never lives whole.

For every predicted block position i (label index j = anchor + k) the teacher is
the target's own next-token distribution `p_T = softmax(W·h_T / T)` from its
last-layer hidden state at j - 1 (detached), the student `p_S = softmax(W_S·h_S / T)`
from the drafter's final hidden state, with the shared LM head:

    L = α · Σ_i w_i CE(p_S,i, argmax p_T,i) / N  +  (1 − α) · KLterm
    KLterm = clip_mode "position":  Σ_i w_i min(T² KL_i(p_S ‖ p_T) / N, τ)     (the reference's)
             clip_mode "mean":      min(Σ_i w_i T² KL_i(p_S ‖ p_T) / N, τ)     (NOT the reference's)

with w_i the DFlash position weights times validity and N = Σ w_i. "position" is the
published AdaFlash code (`kd_raw /= valid_token_count`, then an elementwise clamp at τ,
then the weighted sum); τ = None (its default) turns the clamp off. "mean" clips the
batch term instead, an earlier reading kept only to reproduce runs made with it: once
the mean KL exceeds τ the KL gradient is exactly zero and only CE trains.

Reduced draft vocabulary (`d2t`, int32 [K] target ids): the student is a distribution
over the K draft tokens, its logits from the K matching columns of the head; the teacher
stays over all V. KL(p_S ‖ p_T) = Σ_{i∈K} p_S(i) (log p_S(i) − log p_T(d2t(i))) is still
exact (p_S is zero outside the K). The CE label is the teacher's argmax mapped into the
draft vocabulary; where it falls outside, that position has no CE (as in the offline
loss) and the CE is normalised by the weights of the positions that have one.

Memory: logits are produced `chunk` tokens at a time inside a rematerialised scan
(`jax.checkpoint`): forward and backward each hold one [chunk, V] float32 slab per
operand, never [tokens, V], so a 151k vocabulary fits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from adaflash_jax.models.length_head import draft_confidence

CLIP_MODES = ("position", "mean")


def _chunk_terms(h_s, h_t, w_head, w_student, d2t, temperature):
    """Per token: CE vs the teacher argmax (0 where it has no draft index), reverse KL, whether
    the CE label exists, student argmax == teacher argmax, the student argmax as a target id
    and its probability at temperature 1 (the length head's confidence input; no gradient)."""
    z_s = jnp.einsum("td,dk->tk", h_s, w_student, preferred_element_type=jnp.float32) / temperature
    z_t = jnp.einsum("td,dv->tv", h_t, w_head, preferred_element_type=jnp.float32) / temperature
    logp_s = jax.nn.log_softmax(z_s, axis=-1)
    logp_t = jax.nn.log_softmax(jax.lax.stop_gradient(z_t), axis=-1)
    teacher = jnp.argmax(logp_t, axis=-1).astype(jnp.int32)  # target id
    student = jnp.argmax(logp_s, axis=-1).astype(jnp.int32)  # draft index
    if d2t is None:
        label, has_label, logp_t_k, student_id = teacher, jnp.ones_like(teacher, bool), logp_t, student
    else:
        pos = jnp.clip(jnp.searchsorted(d2t, teacher), 0, d2t.shape[0] - 1).astype(jnp.int32)
        has_label = jnp.take(d2t, pos) == teacher
        label, logp_t_k, student_id = pos, jnp.take(logp_t, d2t, axis=-1), jnp.take(d2t, student)
    ce = -jnp.take_along_axis(logp_s, label[:, None], axis=-1)[:, 0]
    ce = jnp.where(has_label, ce, 0.0)
    kl = jnp.sum(jnp.exp(logp_s) * (logp_s - logp_t_k), axis=-1)  # KL(p_S || p_T), exact
    confidence = draft_confidence(jax.lax.stop_gradient(z_s * temperature))
    return ce, kl, has_label, student_id == teacher, student_id, confidence


def opd_terms(h_student, h_teacher, w_head, *, d2t=None, temperature: float = 1.0, chunk: int = 1024,
              remat: bool = True):
    """Per-token CE, reverse KL, CE-label presence, argmax agreement, student argmax (target
    ids) and its probability for hidden states [N, D] and the target's head [D, V]; `d2t` [K]
    restricts the student.

    Scans over `chunk`-token slices with rematerialisation (see the module doc); `remat=False`
    keeps the chunks' softmaxes for the backward pass instead of recomputing both LM-head
    products, which is faster when [N, V] float32 fits in memory several times over.
    """
    n, d = h_student.shape
    size = max(1, min(chunk, n))
    pad = (-n) % size
    hs = jnp.pad(h_student, ((0, pad), (0, 0))).reshape(-1, size, d)
    ht = jnp.pad(jax.lax.stop_gradient(h_teacher), ((0, pad), (0, 0))).reshape(-1, size, d)
    if d2t is not None:
        d2t = jnp.asarray(d2t, jnp.int32)
    w_student = w_head if d2t is None else jnp.take(w_head, d2t, axis=1)
    body = functools.partial(_chunk_terms, d2t=d2t, temperature=temperature)
    body = jax.checkpoint(body) if remat else body

    def step(_, xs):
        return None, body(xs[0], xs[1], w_head, w_student)

    _, terms = jax.lax.scan(step, None, (hs, ht))
    return tuple(x.reshape(-1)[:n] for x in terms)


def opd_loss(h_student, h_teacher, w_head, weights, *, d2t=None, alpha: float = 0.5,
             temperature: float = 1.0, clip: float | None = None, clip_mode: str = "position",
             chunk: int = 1024, remat: bool = True):
    """The OPD loss (module doc) over tokens: h_* [N, D], w_head [D, V], weights [N] (0 = ignore);
    `clip` is τ (None: no clamp), `d2t` a reduced draft vocabulary.

    Returns (loss, metrics) with the CE and KL terms, the teacher-argmax accuracy and, per
    token, the student's argmax as a target id, `student_tokens` [N], and its probability,
    `student_confidence` [N] (the length head's labels and confidence input need them, and
    they come free with the logits computed here).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip (τ) must be positive or None (no clamp), got {clip}")
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    ce, kl, has_label, agree, student, confidence = opd_terms(
        h_student, h_teacher, w_head, d2t=d2t, temperature=temperature, chunk=chunk, remat=remat)
    weights = weights.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(weights), 1e-9)
    ce_w = weights * has_label
    ce_term = jnp.sum(ce_w * ce) / jnp.maximum(jnp.sum(ce_w), 1e-9)
    kl_per_n = temperature ** 2 * kl / total  # each position's KL divided by N
    kl_mean = jnp.sum(weights * kl_per_n)
    if clip is None:
        kl_term = kl_mean
    elif clip_mode == "position":
        kl_term = jnp.sum(weights * jnp.minimum(kl_per_n, clip))
    else:
        kl_term = jnp.minimum(kl_mean, clip)
    loss = alpha * ce_term + (1.0 - alpha) * kl_term
    counted = weights > 0
    metrics = {"ce": ce_term, "reverse_kl": kl_mean, "kl_term": kl_term,
               "teacher_argmax_accuracy": jnp.sum(agree & counted) / jnp.maximum(jnp.sum(counted), 1),
               "student_tokens": student, "student_confidence": confidence}
    return loss, metrics

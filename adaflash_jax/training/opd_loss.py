"""The AdaFlash on-policy distillation loss, chunked over tokens so [tokens, V] never lives whole.

For every predicted block position i (label index j = anchor + k) the teacher is
the target's own next-token distribution `p_T = softmax(W·h_T / T)` from its
last-layer hidden state at j - 1 (detached), the student `p_S = softmax(W·h_S / T)`
from the drafter's final hidden state, with the shared LM head W:

    L = α · Σ w_i CE(p_S,i, argmax p_T,i) / N  +  (1 − α) · KLterm
    KLterm = clip_mode "mean":  min(Σ w_i T² KL(p_S,i ‖ p_T,i) / N, clip)     (the reference's)
             clip_mode "token": Σ w_i min(T² KL(p_S,i ‖ p_T,i), clip) / N

with w_i the DFlash position weights times validity and N = Σ w_i. Clip semantics:
"mean" clips the already normalised batch term (the reference code's choice): once
the mean reverse KL exceeds `clip` its gradient is zero and only the CE term trains,
so the KL term acts as a fine-tuning signal near convergence. "token" clips each
position, so outlier positions stop contributing while the rest keep their gradient.

Memory: logits are produced `chunk` tokens at a time inside a rematerialised scan
(`jax.checkpoint`): forward and backward each hold one [chunk, V] float32 slab per
operand, never [tokens, V], so a 151k vocabulary fits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

CLIP_MODES = ("mean", "token")


def _chunk_terms(h_s, h_t, w_head, temperature):
    """Per-token (CE vs teacher argmax, reverse KL, student argmax == teacher argmax, student argmax)."""
    z_s = jnp.einsum("td,dv->tv", h_s, w_head, preferred_element_type=jnp.float32) / temperature
    z_t = jnp.einsum("td,dv->tv", h_t, w_head, preferred_element_type=jnp.float32) / temperature
    logp_s = jax.nn.log_softmax(z_s, axis=-1)
    logp_t = jax.nn.log_softmax(jax.lax.stop_gradient(z_t), axis=-1)
    teacher = jnp.argmax(logp_t, axis=-1)
    ce = -jnp.take_along_axis(logp_s, teacher[:, None], axis=-1)[:, 0]
    kl = jnp.sum(jnp.exp(logp_s) * (logp_s - logp_t), axis=-1)  # KL(p_S || p_T), exact over V
    student = jnp.argmax(logp_s, axis=-1)
    return ce, kl, student == teacher, student


def opd_terms(h_student, h_teacher, w_head, *, temperature: float = 1.0, chunk: int = 1024,
              remat: bool = True):
    """Per-token CE, reverse KL, argmax agreement and student argmax for hidden states [N, D],
    head [D, V].

    Scans over `chunk`-token slices with rematerialisation (see the module doc); `remat=False`
    keeps the chunks' softmaxes for the backward pass instead of recomputing both LM-head
    products, which is faster when [N, V] float32 fits in memory several times over.
    """
    n, d = h_student.shape
    size = max(1, min(chunk, n))
    pad = (-n) % size
    hs = jnp.pad(h_student, ((0, pad), (0, 0))).reshape(-1, size, d)
    ht = jnp.pad(jax.lax.stop_gradient(h_teacher), ((0, pad), (0, 0))).reshape(-1, size, d)
    body = functools.partial(_chunk_terms, temperature=temperature)
    body = jax.checkpoint(body) if remat else body

    def step(_, xs):
        return None, body(xs[0], xs[1], w_head)

    _, terms = jax.lax.scan(step, None, (hs, ht))
    return tuple(x.reshape(-1)[:n] for x in terms)


def opd_loss(h_student, h_teacher, w_head, weights, *, alpha: float = 0.8, temperature: float = 1.0,
             clip: float = 0.01, clip_mode: str = "mean", chunk: int = 1024, remat: bool = True):
    """The OPD loss (module doc) over tokens: h_* [N, D], w_head [D, V], weights [N] (0 = ignore).

    Returns (loss, metrics) with the CE and KL terms, the teacher-argmax accuracy and, per
    token, the student's argmax `student_tokens` [N] (the length head's labels need it, and
    it comes free with the logits computed here).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if temperature <= 0 or clip <= 0:
        raise ValueError(f"temperature and clip must be positive, got {temperature}, {clip}")
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    ce, kl, agree, student = opd_terms(h_student, h_teacher, w_head, temperature=temperature, chunk=chunk,
                                       remat=remat)
    weights = weights.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(weights), 1e-9)
    ce_term = jnp.sum(weights * ce) / total
    kl_scaled = temperature ** 2 * kl
    kl_mean = jnp.sum(weights * kl_scaled) / total
    if clip_mode == "mean":
        kl_term = jnp.minimum(kl_mean, clip)
    else:
        kl_term = jnp.sum(weights * jnp.minimum(kl_scaled, clip)) / total
    loss = alpha * ce_term + (1.0 - alpha) * kl_term
    counted = weights > 0
    metrics = {"ce": ce_term, "reverse_kl": kl_mean, "kl_term": kl_term,
               "teacher_argmax_accuracy": jnp.sum(agree & counted) / jnp.maximum(jnp.sum(counted), 1),
               "student_tokens": student}
    return loss, metrics

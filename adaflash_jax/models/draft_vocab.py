"""Reduced draft vocabulary (EAGLE-3's d2t / t2d, FR-Spec): the drafter's head over K tokens.

The LM head dominates a small drafter's cost (SmolLM2: 49152 × 576, 3.5× the
drafter's two layers per position). A drafter with `draft_vocab_size = K`
predicts over the K most frequent target tokens only: its head is the K
matching rows of the target's own head, and `d2t[i]` (int32 [K], ascending)
maps draft index i to its target id. Training and drafting then pay K/V of
the head. Decoding stays lossless because the target verifies: a target token
outside the K never matches a draft, and at T > 0 the draft distribution q is
zero outside the K, which the acceptance rule already handles.

The functions here are the only place that knows whether a drafter's
vocabulary is reduced; everything else asks them for logits, tokens or labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.common import choose_kernel
from pallas_kernels.fused_verify import verify_head


class DraftVocab(nnx.Variable):
    """d2t: int32 [K] target ids of the draft vocabulary (not trained, saved with the drafter)."""


def frequent_tokens(token_arrays, vocab_size: int, k: int, *, always=()) -> np.ndarray:
    """d2t: the `k` most frequent ids in `token_arrays` (iterables of id arrays), ascending.

    Ties break towards the smaller id; ids in `always` (e.g. end-of-sequence tokens) are kept
    whatever their count, so a drafter can always propose stopping.
    """
    if not 0 < k <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {k}")
    counts = np.zeros(vocab_size, np.int64)
    for ids in token_arrays:
        ids = np.asarray(ids, np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        counts += np.bincount(ids, minlength=vocab_size)
    forced = sorted({int(i) for i in always})
    if len(forced) > k:
        raise ValueError(f"{len(forced)} always-kept tokens do not fit a draft vocabulary of {k}")
    counts[forced] = np.iinfo(np.int64).max
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    return np.sort(order[:k]).astype(np.int32)


def check_d2t(d2t, vocab_size: int) -> np.ndarray:
    """Validates a d2t table (strictly ascending target ids in range) and returns it as int32."""
    d2t = np.asarray(d2t)
    if d2t.ndim != 1 or d2t.size == 0:
        raise ValueError(f"d2t must be a non-empty 1-D table of target ids, got shape {d2t.shape}")
    if d2t.min() < 0 or d2t.max() >= vocab_size:
        raise ValueError(f"d2t holds ids outside the target vocabulary [0, {vocab_size})")
    if np.any(np.diff(d2t) <= 0):
        raise ValueError("d2t must list distinct target ids in ascending order")
    return d2t.astype(np.int32)


def coverage(d2t, token_arrays) -> float:
    """Share of the tokens in `token_arrays` that the draft vocabulary can propose."""
    inside = total = 0
    table = np.asarray(d2t)
    for ids in token_arrays:
        ids = np.asarray(ids).ravel()
        inside += int(np.isin(ids, table).sum())
        total += ids.size
    return inside / max(total, 1)


def is_reduced(drafter) -> bool:
    return getattr(drafter, "d2t", None) is not None


def d2t_or_none(drafter) -> jax.Array | None:
    """The target id of each draft-vocabulary column, or None for the full vocabulary."""
    return drafter.d2t[...] if is_reduced(drafter) else None


def head_matrix(target, drafter) -> tuple[jax.Array, str]:
    """The drafter's output projection and its layout: the target's head ("vd" [V, D] or
    "dv" [D, V]), or its K draft rows as [K, D] ("vd")."""
    w, layout = target.head_weight()
    if not is_reduced(drafter):
        return w, layout
    d2t = drafter.d2t[...]
    return (jnp.take(w, d2t, axis=0) if layout == "vd" else jnp.take(w, d2t, axis=1).T), "vd"


def logits(target, drafter, hidden: jax.Array) -> jax.Array:
    """float32 logits over the DRAFT vocabulary ([..., K], or [..., V] when not reduced)."""
    if not is_reduced(drafter):
        return target.logits(hidden)
    w, _ = head_matrix(target, drafter)
    h = hidden.astype(target.cfg.compute_dtype)
    return jnp.einsum("...d,kd->...k", h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def greedy_tokens(target, drafter, hidden: jax.Array, attn_impl: str = "xla") -> jax.Array:
    """Argmax draft tokens as TARGET ids, int32 [...] (Pallas: the vocabulary-tiled head)."""
    if not is_reduced(drafter):
        return target.greedy_tokens(hidden, attn_impl)
    if choose_kernel(attn_impl).use_pallas:
        w, layout = head_matrix(target, drafter)
        idx = verify_head(hidden.astype(target.cfg.compute_dtype), w, weight_layout=layout,
                          impl=attn_impl).argmax
    else:
        idx = jnp.argmax(logits(target, drafter, hidden), axis=-1)
    return to_target(drafter, idx.astype(jnp.int32))


def to_target(drafter, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary indices -> target ids (identity when not reduced)."""
    return jnp.take(drafter.d2t[...], draft_ids, axis=0) if is_reduced(drafter) else draft_ids


def to_draft(drafter, target_ids: jax.Array) -> jax.Array:
    """Target ids -> draft-vocabulary indices, -1 for ids outside it (identity when not reduced)."""
    if not is_reduced(drafter):
        return target_ids
    d2t = drafter.d2t[...]
    pos = jnp.clip(jnp.searchsorted(d2t, target_ids), 0, d2t.shape[0] - 1).astype(jnp.int32)
    return jnp.where(jnp.take(d2t, pos) == target_ids, pos, -1)


def spread_to_target(drafter, values: jax.Array, vocab_size: int) -> jax.Array:
    """Draft-vocabulary logits or log-probabilities [..., K] spread over the target vocabulary
    [..., V], -inf outside the draft vocabulary (there, q of the acceptance rule is zero)."""
    if not is_reduced(drafter):
        return values
    full = jnp.full(values.shape[:-1] + (vocab_size,), -jnp.inf, values.dtype)
    return full.at[..., drafter.d2t[...]].set(values)


def full_logits(target, drafter, hidden: jax.Array) -> jax.Array:
    """Draft logits over the TARGET vocabulary [..., V] (-inf outside a reduced vocabulary)."""
    return spread_to_target(drafter, logits(target, drafter, hidden), target.cfg.vocab_size)

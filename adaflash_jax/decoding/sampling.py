"""The target's next-token distribution and how tokens are drawn from it.

Autoregressive and speculative decoding share these functions, so that "the
target's distribution" (temperature, then top-p) is one definition: lossless
speculative sampling must reproduce exactly what AR sampling draws from.
Randomness is counter-based: the key of (sequence row, token index) is
`fold_in(fold_in(seed_key, row), index)`, independent of batch composition.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature == 0 means greedy (argmax); top_p in (0, 1] filters the nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_log_probs(logits: jax.Array, temperature, top_p) -> jax.Array:
    """log p over the vocabulary after temperature and top-p; -inf outside the nucleus.

    logits: float32 [..., V]. Ties at the nucleus boundary are kept (the set is
    every token whose probability is >= the smallest kept probability). top_p >= 1 keeps
    every token: the float32 cumulative sum saturates at 1.0 before the tail, which would
    otherwise drop tokens of tiny but nonzero probability.

    The nucleus needs a sort of the whole vocabulary per position (on a CPU, seconds per
    step for a batch-32 16-token verify over 49k tokens), so it runs only when some row asks
    for top_p < 1; either way a row with top_p >= 1 gets the same numbers.
    """
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    top_p = jnp.asarray(top_p)

    def nucleus(logp):
        probs = jnp.exp(logp)
        sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
        exclusive_cumsum = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = (exclusive_cumsum < top_p) | (top_p >= 1.0)
        threshold = jnp.min(jnp.where(keep_sorted, sorted_probs, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(probs >= threshold, logp, -jnp.inf)

    kept = jax.lax.cond(jnp.all(top_p >= 1.0), lambda x: x, nucleus, logp)
    return jax.nn.log_softmax(kept, axis=-1)


def token_keys(seed_key: jax.Array, rows: jax.Array, index: jax.Array) -> jax.Array:
    """One PRNG key per row for token `index` of that row (index: int [B] or scalar)."""
    index = jnp.broadcast_to(index, rows.shape)
    return jax.vmap(lambda r, i: jax.random.fold_in(jax.random.fold_in(seed_key, r), i))(rows, index)


def stream_keys(seed_keys: jax.Array, streams: jax.Array, index: jax.Array) -> jax.Array:
    """`token_keys` with one seed key per row: key of token `index` of stream `streams[i]`
    under `seed_keys[i]` (equal to token_keys when every row shares one seed key)."""
    index = jnp.broadcast_to(index, streams.shape)
    return jax.vmap(lambda k, r, i: jax.random.fold_in(jax.random.fold_in(k, r), i))(
        seed_keys, streams, index)


# The token id a row gets when its logits hold a NaN or an infinity: no real token, so the
# engine's `commit` sees it and ends that slot's request with an error (`DecodeState.nonfinite`).
NONFINITE_TOKEN = -1


def finite_rows(logits: jax.Array) -> jax.Array:
    """bool [...]: True where a row of logits [..., V] is all finite (one reduction per row)."""
    return jnp.all(jnp.isfinite(logits), axis=-1)


class CheckedLogProbs(NamedTuple):
    """What sampled verification scores positions with: the target's log-probs [..., V]
    (`target_log_probs`) and whether each position's logits were all finite [...]: log-probs
    alone cannot tell, since top-p leaves -inf in them."""

    logp: jax.Array
    finite: jax.Array


def checked_log_probs(logits: jax.Array, temperature, top_p) -> CheckedLogProbs:
    """`target_log_probs` of logits [..., V], with `finite_rows` of the same logits."""
    return CheckedLogProbs(target_log_probs(logits, temperature, top_p), finite_rows(logits))


def sample_next(logits: jax.Array, keys: jax.Array, greedy: bool, temperature, top_p) -> jax.Array:
    """Draws one token per row from logits [B, V] (argmax when greedy); NONFINITE_TOKEN for a
    row whose logits are not all finite (its draw would be meaningless).

    `greedy` is static (it picks the compiled path); temperature and top_p may be
    traced, so changing them does not recompile (scalars, or [B, 1] for one per row).
    """
    if greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        logp = target_log_probs(logits, temperature, top_p)
        tok = jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)
    return jnp.where(finite_rows(logits), tok, NONFINITE_TOKEN)

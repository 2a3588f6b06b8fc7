"""Packed variable-length verification: Σ L_i tokens in one target pass instead of B × Bs.

Each row's first L_i block tokens (bonus + drafts) are packed into one buffer,
padded to one of a few static shapes; `lax.switch` picks the shape's compiled
branch at run time, so a step pays for the tokens it verifies and the number of
compiled shapes stays bounded. A shape is (slots N, width W): W bounds every
L_i and is the padded width the XLA attention works at, so the AR-step shape
(N = B, W = 1) costs what a plain AR step costs, while drafted steps use W = Bs. Results come back in the
padded [B, Bs] layout (unverified slots are zeros and never read: the
acceptance rules only look at the first L_i positions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding.packing import pack, pack_layout, unpack
from adaflash_jax.decoding.sampling import target_log_probs


def verify_packed(target, block_tokens: jax.Array, lengths: jax.Array, cache,
                  shapes: tuple[tuple[int, int], ...], shape: jax.Array, *, layer_ids, attn_impl: str,
                  greedy: bool, temperature=None, top_p=None):
    """block_tokens int [B, Bs], lengths int [B] (0..W of the chosen shape), shape: index
    into `shapes`, the static (slots, width) pairs.

    Returns (greedy: target argmax ids int [B, Bs]; sampling: target log-probs
    [B, Bs, V]), features [B, Bs, k·D], and the cache with the verified tokens'
    K/V written (lengths not advanced).
    """
    bs = block_tokens.shape[1]

    def branch(num_slots: int, width: int):
        def run(operands):
            tokens, lengths, cache = operands
            layout = pack_layout(lengths, num_slots, width)
            out = target.packed_forward(pack(tokens, layout), layout, cache, feature_layers=layer_ids,
                                        attn_impl=attn_impl)
            logits = target.logits(out.hidden)  # [N, V]: the LM head runs on verified tokens only
            scored = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if greedy
                      else target_log_probs(logits, temperature, top_p))
            return unpack(scored, layout, bs), unpack(out.features, layout, bs), out.cache
        return run

    return jax.lax.switch(shape, [branch(n, w) for n, w in shapes], (block_tokens, lengths, cache))


def verify_shapes(batch: int, block_size: int, buckets: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The engine's packed shapes: index 0 is the AR step (B slots, width 1), index 1 + k the
    drafted bucket k (buckets[k] slots, width Bs)."""
    return ((batch, 1),) + tuple((n, block_size) for n in buckets)

"""Packed variable-length verification: Σ L_i tokens in one target pass instead of B × Bs.

Each row's first L_i block tokens (bonus + drafts) are packed into one buffer,
padded to the smallest of a few static bucket sizes; `lax.switch` picks the
bucket's compiled branch at run time, so a step pays for the tokens it verifies
and the number of compiled shapes stays bounded. Results come back in the
padded [B, Bs] layout (unverified slots are zeros and never read: the
acceptance rules only look at the first L_i positions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decoding.packing import pack, pack_layout, unpack
from adaflash_jax.decoding.sampling import target_log_probs


def verify_packed(target, block_tokens: jax.Array, lengths: jax.Array, cache, buckets: tuple[int, ...],
                  bucket: jax.Array, *, layer_ids, attn_impl: str, greedy: bool, temperature=None,
                  top_p=None):
    """block_tokens int [B, Bs], lengths int [B] (0..Bs), bucket: index into `buckets`.

    Returns (greedy: target argmax ids int [B, Bs]; sampling: target log-probs
    [B, Bs, V]), features [B, Bs, k·D], and the cache with the verified tokens'
    K/V written (lengths not advanced).
    """
    bs = block_tokens.shape[1]

    def branch(num_slots: int):
        def run(operands):
            tokens, lengths, cache = operands
            layout = pack_layout(lengths, num_slots, bs)
            out = target.packed_forward(pack(tokens, layout), layout, cache, feature_layers=layer_ids,
                                        attn_impl=attn_impl)
            logits = target.logits(out.hidden)  # [N, V]: the LM head runs on verified tokens only
            scored = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if greedy
                      else target_log_probs(logits, temperature, top_p))
            return unpack(scored, layout, bs), unpack(out.features, layout, bs), out.cache
        return run

    return jax.lax.switch(bucket, [branch(n) for n in buckets], (block_tokens, lengths, cache))

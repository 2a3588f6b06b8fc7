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

from adaflash_jax.decoding.verify_head import run_verify_head
from adaflash_jax.models.packed_layout import pack, pack_layout, unpack
from adaflash_jax.decoding.sampling import checked_log_probs
from adaflash_jax.models.drafter import append_context


def verify_packed(target, block_tokens: jax.Array, lengths: jax.Array, cache,
                  shapes: tuple[tuple[int, int], ...], shape: jax.Array, *, layer_ids, attn_impl: str,
                  drafter, ctx, greedy: bool, temperature=None, top_p=None,
                  verify_head_inputs=None):
    """block_tokens int [B, Bs], lengths int [B] (0..W of the chosen shape), shape: index
    into `shapes`, the static (slots, width) pairs; temperature / top_p: float [B], per row.

    The verified tokens' target features go straight into the drafter's context
    cache `ctx` inside the branch, at the branch's width (an AR step projects one
    token per row, not Bs).

    Returns (greedy: target argmax ids int [B, Bs]; sampling: `sampling.CheckedLogProbs`
    ([B, Bs, V] log-probs, [B, Bs] finite flags), or with `verify_head_inputs` (a
    `verify_head.VerifyHeadInputs` [B, Bs]) the fused verify head's outputs [B, Bs]
    instead), the drafter context cache and the target cache, both with the verified
    tokens written (lengths not advanced).
    """
    bs = block_tokens.shape[1]

    def branch(num_slots: int, width: int):
        def run(operands):
            tokens, lengths, cache, ctx = operands
            layout = pack_layout(lengths, num_slots, width)
            out = target.packed_forward(pack(tokens, layout), layout, cache, feature_layers=layer_ids,
                                        attn_impl=attn_impl)
            # The LM head runs on verified tokens only (fused over the vocabulary with Pallas).
            if greedy:
                scored = target.greedy_tokens(out.hidden, attn_impl)
            elif verify_head_inputs is not None:
                packed = verify_head_inputs._replace(**{f: pack(getattr(verify_head_inputs, f), layout) for f in (
                    "draft_ids", "exclude_ids", "counters", "inv_temperature")})
                scored = run_verify_head(target, out.hidden, packed, attn_impl)
            else:  # each packed token at its row's temperature and top-p
                scored = checked_log_probs(target.logits(out.hidden), temperature[layout.seq_ids][:, None],
                                           top_p[layout.seq_ids][:, None])
            positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
            ctx = append_context(drafter, ctx, unpack(out.features, layout, width), positions)
            return jax.tree.map(lambda x: unpack(x, layout, bs), scored), ctx, out.cache
        return run

    return jax.lax.switch(shape, [branch(n, w) for n, w in shapes], (block_tokens, lengths, cache, ctx))


def verify_shapes(batch: int, block_size: int, buckets: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The engine's packed shapes: index 0 is the AR step (B slots, width 1), index 1 + k the
    drafted bucket k (buckets[k] slots, width Bs)."""
    return ((batch, 1),) + tuple((n, block_size) for n in buckets)

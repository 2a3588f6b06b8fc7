"""DFlash training blocks: random anchors inside responses and the block mask.

A sequence of T tokens (prompt + response) yields N blocks. Block n starts
at anchor position a_n with tokens `[x_{a_n}, MASK, ..., MASK]`; offset k
predicts x_{a_n + k}. It attends to the target features strictly before its
anchor (exactly what the engine has cached when it drafts from that anchor)
and bidirectionally to its own block; blocks never see each other, so all N
blocks of a sequence train in one pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_anchors(key: jax.Array, prompt_lens: jax.Array, seq_lens: jax.Array, *,
                   seq_len: int, num_blocks: int) -> tuple[jax.Array, jax.Array]:
    """Anchors int [B, N] (sorted) and validity bool [B, N] for padded length `seq_len`.

    Valid anchors lie in [prompt_len, seq_len_b - 2]: the first draft of a
    reply is anchored on its first token, and every block needs one label.
    Drawn without replacement (Gumbel top-k); rows with fewer candidates than
    N get invalid blocks (anchor 0, valid False).
    """
    positions = jnp.arange(seq_len)

    def one(k, lo, hi):
        ok = (positions >= lo) & (positions <= hi)
        scores = jnp.where(ok, jax.random.gumbel(k, (seq_len,)), -jnp.inf)
        top, idx = jax.lax.top_k(scores, num_blocks)
        valid = jnp.isfinite(top)
        order = jnp.argsort(jnp.where(valid, idx, seq_len))
        return jnp.where(valid, idx, 0)[order].astype(jnp.int32), valid[order]

    keys = jax.random.split(key, prompt_lens.shape[0])
    return jax.vmap(one)(keys, prompt_lens, seq_lens - 2)


def block_inputs(tokens: jax.Array, anchors: jax.Array, *, block_size: int, mask_token_id: int):
    """Block tokens/positions [B, N*Bs] and labels/label-validity [B, N, Bs].

    Labels at offset k are x_{a+k} (offset 0 is the anchor itself: never a loss
    target). Positions past the sequence are clipped for the gather and marked
    invalid by the caller via `label_valid`.
    """
    b, t = tokens.shape
    n = anchors.shape[1]
    offsets = jnp.arange(block_size)
    pos = anchors[..., None] + offsets  # [B, N, Bs]
    labels = jnp.take_along_axis(tokens, jnp.minimum(pos, t - 1).reshape(b, -1), axis=1)
    labels = labels.reshape(b, n, block_size)
    block_tokens = jnp.where(offsets == 0, labels, mask_token_id)
    return block_tokens.reshape(b, n * block_size), pos.reshape(b, n * block_size), labels, pos


def block_attention_mask(anchors: jax.Array, *, seq_len: int, block_size: int) -> jax.Array:
    """bool [B, N*Bs, seq_len + N*Bs] over (context keys ; block keys)."""
    b, n = anchors.shape
    ctx = jnp.arange(seq_len)[None, None, :] < anchors[..., None]  # [B, N, T]
    ctx = jnp.repeat(ctx, block_size, axis=1)  # [B, N*Bs, T]
    block_id = jnp.arange(n * block_size) // block_size
    own = block_id[:, None] == block_id[None, :]  # [N*Bs, N*Bs]
    return jnp.concatenate([ctx, jnp.broadcast_to(own, (b, n * block_size, n * block_size))], -1)


def position_weights(block_size: int, gamma: float) -> jax.Array:
    """w_k = exp(-(k-1)/γ) for k >= 1; w_0 = 0 (the anchor is given, not predicted)."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)


def default_gamma(block_size: int) -> float:
    """DFlash's decay: γ = 7 for B=16, 5 for B=10, 4 for B=8 (interpolated otherwise)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    return table.get(block_size, max(1.0, 7.0 * block_size / 16))

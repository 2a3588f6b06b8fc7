"""The AdaFlash adaptive length head: how many of a drafted block's tokens are worth verifying.

From the drafter's final-norm hidden states of one block, [Bs, D] (detached: the
head never changes the drafter), it pools u = [mean over positions ; last
position] (2D), then `g = SiLU(W_down u + b)`, `g = g + SiLU(W_res g + b)`,
`ŝ = sigmoid(w_out g + b)`: one score per block, trained by MSE towards
`s = clamp(a + 1, 0, Bs) / Bs`, where a is the block's teacher-forced greedy
accepted count. At inference `Lv = clamp(round(ŝ · Bs · ρ), Lmin, Bs)`
(`decoding.length_policy.verify_lengths`).

Parameter names follow the published AdaFlash checkpoints' head
(`thresh_head_two_model.{down, res.0, out}` Linear layers with biases), see
`HF_NAMES`, so a head trained here and one trained there are interchangeable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

DEFAULT_BOTTLENECK = 256
# our parameter -> (HF tensor name, transpose?) in the published layout (torch Linear: [out, in]).
HF_NAMES = {
    "w_down": ("thresh_head_two_model.down.weight", True),
    "b_down": ("thresh_head_two_model.down.bias", False),
    "w_res": ("thresh_head_two_model.res.0.weight", True),
    "b_res": ("thresh_head_two_model.res.0.bias", False),
    "w_out": ("thresh_head_two_model.out.weight", True),
    "b_out": ("thresh_head_two_model.out.bias", False),
}


class LengthHead(nnx.Module):
    """Scores a drafted block: predicted fraction of the block that greedy verification accepts."""

    def __init__(self, hidden_size: int, bottleneck: int = DEFAULT_BOTTLENECK, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        def linear(fan_in, fan_out, axes):
            bound = 1.0 / jnp.sqrt(fan_in)  # torch.nn.Linear's default init range
            w = jax.random.uniform(rngs.params(), (fan_in, fan_out), jnp.float32, -bound, bound)
            b = jax.random.uniform(rngs.params(), (fan_out,), jnp.float32, -bound, bound)
            return (nnx.Param(w.astype(param_dtype), logical_axes=axes),
                    nnx.Param(b.astype(param_dtype), logical_axes=(axes[1],)))

        self.hidden_size, self.bottleneck = hidden_size, bottleneck
        self.w_down, self.b_down = linear(2 * hidden_size, bottleneck, ("embed", None))
        self.w_res, self.b_res = linear(bottleneck, bottleneck, (None, None))
        self.w_out, self.b_out = linear(bottleneck, 1, (None, None))

    def __call__(self, block_hidden: jax.Array) -> jax.Array:
        """block_hidden [B, Bs, D] -> ŝ float32 [B] in (0, 1); no gradient reaches the input."""
        x = jax.lax.stop_gradient(block_hidden).astype(jnp.float32)
        u = jnp.concatenate([jnp.mean(x, axis=1), x[:, -1]], axis=-1)
        g = jax.nn.silu(u @ self.w_down[...].astype(jnp.float32) + self.b_down[...].astype(jnp.float32))
        g = g + jax.nn.silu(g @ self.w_res[...].astype(jnp.float32) + self.b_res[...].astype(jnp.float32))
        z = g @ self.w_out[...].astype(jnp.float32) + self.b_out[...].astype(jnp.float32)
        return jax.nn.sigmoid(z[:, 0])


def accepted_counts(draft_tokens: jax.Array, labels: jax.Array, valid: jax.Array) -> jax.Array:
    """Teacher-forced greedy acceptance a per block: leading matches over offsets 1..Bs-1.

    draft_tokens / labels int [..., Bs] (offset 0 is the anchor and never counted),
    valid bool [..., Bs] (a position past the sequence end is never a match).
    """
    hit = (draft_tokens[..., 1:] == labels[..., 1:]) & valid[..., 1:]
    return jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=-1), axis=-1)


def length_labels(accepted: jax.Array, block_size: int) -> jax.Array:
    """s = clamp(a + 1, 0, Bs) / Bs: the fraction of the block a verify step would commit."""
    return jnp.clip(accepted + 1, 0, block_size).astype(jnp.float32) / block_size


def length_loss(scores: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted MSE between predicted and label scores (weights 0 = ignore the block)."""
    w = weights.astype(jnp.float32)
    return jnp.sum(w * (scores - targets) ** 2) / jnp.maximum(jnp.sum(w), 1e-9)

"""The AdaFlash adaptive length head: how many of a drafted block's tokens are worth verifying.

From the drafter's final-norm hidden states of one block, [Bs, D] (detached: the
head never changes the drafter), it pools u = [mean over positions ; last
position] (2D), then `g = SiLU(W_down u + b)`, `g = g + SiLU(W_res g + b)`,
`ŝ = sigmoid(w_out g + b)`: one score per block, trained by MSE towards
`s = clamp(a + 1, 0, Bs) / Bs`, where a is the block's teacher-forced greedy
accepted count. At inference `Lv = clamp(round(ŝ · Bs · ρ), Lmin, Bs)`
(`decoding.length_policy.verify_lengths`).

Confidence input (`confidence_width = Bs − 1`; not in the published head): the
drafter's own probabilities of its drafts at offsets 1..Bs−1 enter the first layer as
their running products c_k = Π_{i≤k} p_i, the chance that the first k drafts all
match if each did so independently, `g = SiLU(W_down u + W_conf c + b)`, and the
output is a learned correction of that estimate: `ŝ = sigmoid(w_out g + b +
logit(s₀))` with `s₀ = (1 + Σ_k c_k) / Bs`, the fraction the drafter itself expects.
A fresh head starts with w_out = 0, b = 0, i.e. at s₀. On the SmolLM2 drafter s₀ alone
correlates 0.79 with the realized accepted count on the fixed evaluation set, a
hidden-state head trained by OPD 0.55 (`benchmarks/block_acceptance.py`).

Parameter names follow the published AdaFlash checkpoints' head
(`thresh_head_two_model.{down, res.0, out}` Linear layers with biases), see
`HF_NAMES`, so a head trained here and one trained there are interchangeable; the
confidence weight is one more tensor (`HF_CONFIDENCE_NAME`) that only this framework
reads.
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
HF_CONFIDENCE_NAME = "thresh_head_two_model.confidence.weight"  # [bottleneck, Bs - 1], ours


class LengthHead(nnx.Module):
    """Scores a drafted block: predicted fraction of the block that greedy verification accepts."""

    def __init__(self, hidden_size: int, bottleneck: int = DEFAULT_BOTTLENECK, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, confidence_width: int = 0):
        def linear(fan_in, fan_out, axes):
            bound = 1.0 / jnp.sqrt(fan_in)  # torch.nn.Linear's default init range
            w = jax.random.uniform(rngs.params(), (fan_in, fan_out), jnp.float32, -bound, bound)
            b = jax.random.uniform(rngs.params(), (fan_out,), jnp.float32, -bound, bound)
            return (nnx.Param(w.astype(param_dtype), logical_axes=axes),
                    nnx.Param(b.astype(param_dtype), logical_axes=(axes[1],)))

        if confidence_width < 0:
            raise ValueError(f"confidence_width must be >= 0 (0: no confidence input), "
                             f"got {confidence_width}")
        self.hidden_size, self.bottleneck, self.confidence_width = hidden_size, bottleneck, confidence_width
        self.w_down, self.b_down = linear(2 * hidden_size, bottleneck, ("embed", None))
        self.w_res, self.b_res = linear(bottleneck, bottleneck, (None, None))
        self.w_out, self.b_out = linear(bottleneck, 1, (None, None))
        if confidence_width:
            self.w_conf = linear(confidence_width, bottleneck, (None, None))[0]
            self.w_out[...] = jnp.zeros_like(self.w_out[...])  # start at the drafter's own estimate
            self.b_out[...] = jnp.zeros_like(self.b_out[...])

    @property
    def uses_confidence(self) -> bool:
        return self.confidence_width > 0

    def __call__(self, block_hidden: jax.Array, confidence: jax.Array | None = None) -> jax.Array:
        """block_hidden [B, Bs, D] -> ŝ float32 [B] in (0, 1); no gradient reaches the inputs.

        confidence [B, Bs-1]: the drafter's probability of each draft (offsets 1..Bs-1),
        required exactly when the head has a confidence input (`draft_confidence`)."""
        x = jax.lax.stop_gradient(block_hidden).astype(jnp.float32)
        u = jnp.concatenate([jnp.mean(x, axis=1), x[:, -1]], axis=-1)
        pre = u @ self.w_down[...].astype(jnp.float32) + self.b_down[...].astype(jnp.float32)
        if (confidence is not None) != self.uses_confidence:
            need = "needs the drafts' confidence [B, Bs-1]" if self.uses_confidence else "takes no confidence input"
            raise ValueError(f"this length head {need}")
        if confidence is not None:
            if confidence.shape[-1] != self.confidence_width:
                raise ValueError(f"confidence has {confidence.shape[-1]} positions, the head was built "
                                 f"for {self.confidence_width} (block size - 1)")
            c = jnp.cumprod(jax.lax.stop_gradient(confidence).astype(jnp.float32), axis=-1)
            pre = pre + c @ self.w_conf[...].astype(jnp.float32)
        g = jax.nn.silu(pre)
        g = g + jax.nn.silu(g @ self.w_res[...].astype(jnp.float32) + self.b_res[...].astype(jnp.float32))
        z = (g @ self.w_out[...].astype(jnp.float32) + self.b_out[...].astype(jnp.float32))[:, 0]
        if confidence is not None:
            z = z + jax.scipy.special.logit(confidence_prior(c))
        return jax.nn.sigmoid(z)


def confidence_prior(running: jax.Array) -> jax.Array:
    """s₀ = (1 + Σ_k c_k) / Bs from the running products c [B, Bs-1], kept inside (0, 1)."""
    s0 = (1.0 + jnp.sum(running, axis=-1)) / (running.shape[-1] + 1)
    return jnp.clip(s0, 1e-4, 1.0 - 1e-4)


def draft_confidence(draft_logits: jax.Array) -> jax.Array:
    """The drafter's probability of its argmax draft per position, float32 [...], from its
    logits [..., K] (the length head's confidence input)."""
    z = draft_logits.astype(jnp.float32)
    return jnp.exp(jnp.max(z, axis=-1) - jax.nn.logsumexp(z, axis=-1))


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

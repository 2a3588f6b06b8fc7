"""The DFlash block-diffusion drafter (arXiv 2602.06036) in Flax NNX.

A few Qwen3-style layers draft a whole block `[anchor, MASK, ...]` in one
non-causal pass. The target's features `H_ctx = RMSNorm(W_c · concat(h_l))`
are injected as extra keys/values in every layer through the SAME k/v
projections as the block (never entering the residual stream), so the
context K/V of a committed token depends only on its features and can be
cached across steps; the block's own K/V are discarded after each draft.
The token embedding and the LM head are the target's (shared, frozen).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.models import layers
from adaflash_jax.models.config import ModelConfig, RopeScaling, resolve_dtype
from adaflash_jax.models.draft_vocab import DraftVocab, check_d2t
from adaflash_jax.models.kv_cache import KVCache
from adaflash_jax.models.decoder_layers import DecoderStack, new_param, attention_out, project_kv, project_q


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's rule: k == 1 -> L//2; else round(1 + i*(L-4)/(k-1)), i.e. layers 1..L-3."""
    L, k = num_target_layers, num_draft_layers
    if k == 1:
        return (L // 2,)
    if L < 4:
        raise ValueError(f"the default target-layer rule needs a target with >= 4 layers, got {L}; "
                         "pass target_layer_ids explicitly")
    return tuple(int(round(1 + i * (L - 4) / (k - 1))) for i in range(k))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Architecture of a DFlash drafter and how it attaches to its target."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    param_dtype: str = "float32"
    draft_vocab_size: int | None = None  # K: predict over K target tokens only (`draft_vocab`)

    def __post_init__(self):
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are out of range for a target with "
                             f"{self.num_target_layers} layers")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be distinct, got {self.target_layer_ids}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        resolve_dtype(self.dtype)
        resolve_dtype(self.param_dtype)
        self.layer_config()  # validates the head layout

    def layer_config(self) -> ModelConfig:
        """The drafter's decoder stack as a (Qwen3-style, q/k-normed) ModelConfig."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            rms_norm_eps=self.rms_norm_eps, qk_norm=True, attention_bias=self.attention_bias,
            max_position_embeddings=self.max_position_embeddings, model_type="qwen3",
            dtype=self.dtype, param_dtype=self.param_dtype)

    def replace(self, **changes) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)

    def check_target(self, target_cfg: ModelConfig) -> None:
        """Raises a clear error when this drafter cannot attach to `target_cfg`."""
        problems = []
        if self.hidden_size != target_cfg.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {target_cfg.hidden_size}")
        if self.vocab_size != target_cfg.vocab_size:
            problems.append(f"vocab size {self.vocab_size} != target's {target_cfg.vocab_size}")
        if self.num_target_layers != target_cfg.num_layers:
            problems.append(f"drafter expects a {self.num_target_layers}-layer target, "
                            f"target has {target_cfg.num_layers}")
        bad = [i for i in self.target_layer_ids if i >= target_cfg.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} out of range for {target_cfg.num_layers} layers")
        if problems:
            raise ValueError("drafter does not match the target: " + "; ".join(problems))


def drafter_config_for(target_cfg: ModelConfig, *, num_layers: int = 2, block_size: int = 16,
                       mask_token_id: int | None = None,
                       target_layer_ids: Sequence[int] | None = None, **overrides) -> DrafterConfig:
    """A drafter config shaped like the target's layers (heads, FFN, rope)."""
    if mask_token_id is None:
        mask_token_id = target_cfg.vocab_size - 1  # callers pass Target.default_mask_token_id
    layer_ids = tuple(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(
        target_cfg.num_layers, num_layers)
    fields = dict(
        hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
        num_layers=num_layers, num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
        head_dim=target_cfg.head_dim, vocab_size=target_cfg.vocab_size,
        target_layer_ids=layer_ids, num_target_layers=target_cfg.num_layers,
        mask_token_id=int(mask_token_id), block_size=block_size, rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=target_cfg.rope_theta, rope_scaling=target_cfg.rope_scaling,
        max_position_embeddings=target_cfg.max_position_embeddings, dtype=target_cfg.dtype,
        param_dtype=target_cfg.param_dtype)
    fields.update(overrides)
    return DrafterConfig(**fields)


class DFlashDrafter(nnx.Module):
    """Drafter weights: feature fusion (fc + hidden_norm), a decoder stack, final norm."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        k, d = len(cfg.target_layer_ids), cfg.hidden_size
        dt = resolve_dtype(cfg.param_dtype)
        self.fc = new_param(rngs.params(), (k * d, d), ("features", "embed"), dt)
        self.hidden_norm = new_param(None, (d,), ("norm",), dt, "ones")
        self.layers = DecoderStack(cfg.layer_config(), rngs=rngs)
        self.norm = new_param(None, (d,), ("norm",), dt, "ones")
        # The draft vocabulary's target ids (set from token frequencies before training).
        self.d2t = None if cfg.draft_vocab_size is None else DraftVocab(
            jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))

    def set_draft_vocab(self, d2t) -> None:
        """Installs the draft vocabulary's target ids (int [K], ascending)."""
        if self.d2t is None:
            raise ValueError("this drafter predicts over the full vocabulary (draft_vocab_size unset)")
        d2t = check_d2t(d2t, self.cfg.vocab_size)
        if d2t.shape[0] != self.cfg.draft_vocab_size:
            raise ValueError(f"d2t has {d2t.shape[0]} ids, the drafter's draft_vocab_size is "
                             f"{self.cfg.draft_vocab_size}")
        self.d2t = DraftVocab(jnp.asarray(d2t))  # replaces an abstract placeholder too

    @property
    def compute_dtype(self):
        return resolve_dtype(self.cfg.dtype)

    def _rope(self, positions):
        inv = layers.rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        return layers.rope_tables(positions, inv)

    def fuse(self, features: jax.Array) -> jax.Array:
        """H_ctx = RMSNorm(W_c · concat(h_l1..h_lk)): [B, T, k*D] -> [B, T, D]."""
        dt = self.compute_dtype
        h = features.astype(dt) @ self.fc[...].astype(dt)
        return layers.rms_norm(h, self.hidden_norm[...], self.cfg.rms_norm_eps)

    def context_kv(self, features: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-layer context K/V [Ld, B, Hkv, T, Dh] of target features at `positions` [B, T]."""
        lcfg = self.cfg.layer_config()
        h_ctx = self.fuse(features)
        cos, sin = self._rope(positions)
        params = self.layers.arrays(self.compute_dtype)
        return jax.vmap(lambda p: project_kv(p, h_ctx, lcfg, cos, sin))(params)

    def __call__(self, block_embeds: jax.Array, block_positions: jax.Array,
                 ctx_k: jax.Array, ctx_v: jax.Array, mask: jax.Array,
                 attn_impl: str = "xla", *, ctx_lengths: jax.Array | None = None,
                 anchors: jax.Array | None = None) -> jax.Array:
        """Final-norm hidden states [B, M, D] of the block positions.

        block_embeds: [B, M, D] target embeddings of the block tokens (M = one or
        many blocks); ctx_k/v: [Ld, B, Hkv, S, Dh] context K/V; mask: bool
        [B, M, S + M] over (context keys ; block keys). ctx_lengths (drafting) or
        anchors (training) describe the same mask for the Pallas kernels
        (`layers.drafter_attention`).
        """
        lcfg = self.cfg.layer_config()
        cos, sin = self._rope(block_positions)
        x = block_embeds.astype(self.compute_dtype)

        def body(x, xs):
            p, lk, lv = xs
            h = layers.rms_norm(x, p["attn_norm"], lcfg.rms_norm_eps)
            q = project_q(p, h, lcfg, cos, sin)
            bk, bv = project_kv(p, h, lcfg, cos, sin)
            attn = layers.drafter_attention(q, lk, lv, bk, bv, mask, ctx_lengths=ctx_lengths,
                                            anchors=anchors, block_size=self.cfg.block_size, impl=attn_impl)
            x = x + attention_out(p, attn)
            h = layers.rms_norm(x, p["mlp_norm"], lcfg.rms_norm_eps)
            return x + layers.swiglu(h, p["w_gate"], p["w_up"], p["w_down"]), None

        x, _ = jax.lax.scan(body, x, (self.layers.arrays(x.dtype), ctx_k, ctx_v))
        return layers.rms_norm(x, self.norm[...], self.cfg.rms_norm_eps)


def new_context_cache(drafter: DFlashDrafter, batch: int, max_len: int) -> KVCache:
    """Drafter context cache: slot j holds the K/V of committed position j."""
    c = drafter.cfg
    return KVCache.create(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim,
                          drafter.compute_dtype)


def append_context(drafter: DFlashDrafter, cache: KVCache, features: jax.Array,
                   positions: jax.Array) -> KVCache:
    """Writes context K/V of features [B, T, kD] at positions [B, T] (contiguous per row,
    starting at positions[:, 0]); lengths are left for the caller to commit."""
    k, v = drafter.context_kv(features, positions)
    return cache.write(k, v, positions[:, 0])


def draft_block(drafter: DFlashDrafter, embed_fn, anchors: jax.Array, cache: KVCache,
                attn_impl: str = "xla") -> jax.Array:
    """Drafts one block per row after the committed context.

    anchors: int [B] (the last committed token of each row, at position
    `cache.lengths`); returns the final hidden states of the whole block
    [B, block_size, D]: offset k >= 1 predicts the token at anchor position + k,
    and the length head pools all offsets (0 included).
    """
    c = drafter.cfg
    b, bs = anchors.shape[0], c.block_size
    tokens = jnp.full((b, bs), c.mask_token_id, jnp.int32).at[:, 0].set(anchors)
    positions = cache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
    ctx_visible = jnp.arange(cache.max_len)[None, :] < cache.lengths[:, None]  # [B, S]
    mask = jnp.concatenate([jnp.broadcast_to(ctx_visible[:, None], (b, bs, cache.max_len)),
                            jnp.ones((b, bs, bs), bool)], axis=-1)
    return drafter(embed_fn(tokens), positions, cache.k, cache.v, mask, attn_impl=attn_impl,
                   ctx_lengths=cache.lengths)

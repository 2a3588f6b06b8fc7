"""The causal target LM (Llama / Qwen3 families) in Flax NNX.

The decoder layers come in two layouts (`models.decoder_layers`): stacked and
run by `lax.scan` (one compiled layer body: short compiles; the default, and
what loading and training use), or per layer and run by an unrolled loop (the
inference layout: no weight or cache copies, each layer's K/V written in place
before it is read). Both give the same numbers. Every parameter carries
logical axis names (`logical_axes` metadata) that `adaflash_jax.parallel.rules`
maps onto a device mesh.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.models import layers
from adaflash_jax.models.config import ModelConfig
from adaflash_jax.models.decoder_layers import (DecoderLayers, DecoderStack, LAYER_LAYOUTS, new_param,
                                                attention_out, project_qkv)
from adaflash_jax.models.kv_cache import (KVCache, write_layer_packed, write_layer_tokens, write_packed,
                                          write_tokens)
from pallas_kernels.common import choose_kernel
from pallas_kernels.fused_verify import verify_head


class ForwardOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] final-norm hidden states ([N, D] from `packed_forward`)
    features: jax.Array | None  # [B, T, k*D] outputs of the requested layers, in request order
    cache: KVCache | None  # cache with new K/V written (lengths NOT advanced)


class TreeForwardOutput(NamedTuple):
    hidden: jax.Array  # [B, N, D] final-norm hidden states of the tree's nodes
    features: jax.Array | None  # [B, N, k*D]
    node_k: jax.Array  # [L, B, Hkv, N, Dh]: the nodes' keys, for `kv_cache.path_entries`
    node_v: jax.Array


class TargetLM(nnx.Module):
    """Causal LM. Call it inside jit (after `nnx.merge`); see `ForwardOutput`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer_layout: str = "stacked"):
        if layer_layout not in LAYER_LAYOUTS:
            raise ValueError(f"unknown layer layout {layer_layout!r}; choose one of {LAYER_LAYOUTS}")
        self.cfg = cfg
        dt = cfg.weight_dtype
        self.embed = new_param(rngs.params(), (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt)
        self.layers = (DecoderLayers if layer_layout == "per_layer" else DecoderStack)(cfg, rngs=rngs)
        self.final_norm = new_param(None, (cfg.hidden_size,), ("norm",), dt, "ones")
        if not cfg.tie_embeddings:
            self.lm_head = new_param(rngs.params(), (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.compute_dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits for final hidden states [..., D]."""
        h = hidden.astype(self.cfg.compute_dtype)
        if self.cfg.tie_embeddings:
            w = self.embed[...].astype(h.dtype)
            return jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)
        w = self.lm_head[...].astype(h.dtype)
        return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)

    def greedy_tokens(self, hidden: jax.Array, attn_impl: str = "xla") -> jax.Array:
        """argmax of the logits, int32 [...] for hidden [..., D]. With a Pallas impl the fused
        head tiles over the vocabulary and never materialises the [..., V] logits.
        A position whose logits are not all finite gets -1 (`sampling.NONFINITE_TOKEN`): no
        draft matches it, and the engine ends that request with an error."""
        if not choose_kernel(attn_impl).use_pallas:
            logits = self.logits(hidden)
            best, finite = jnp.argmax(logits, axis=-1), jnp.all(jnp.isfinite(logits), axis=-1)
        else:
            out = self.verify_head(hidden, attn_impl=attn_impl)
            best, finite = out.argmax, jnp.isfinite(out.lse)  # NaN or +inf anywhere makes lse so
        return jnp.where(finite, best.astype(jnp.int32), -1)

    def verify_head(self, hidden: jax.Array, draft_ids=None, *, temperature=0.0, seed=None,
                    counters=None, exclude_ids=None, attn_impl: str = "xla"):
        """`pallas_kernels.fused_verify.verify_head` with this model's LM head: per position the
        argmax, log-sum-exp, draft logit and (T > 0) a counter-based Gumbel-max sample. The
        kernel under a Pallas impl, its reference (same numbers, logits materialised) under XLA."""
        w, layout = self.head_weight()
        return verify_head(hidden.astype(self.cfg.compute_dtype), w, draft_ids, temperature=temperature,
                           seed=seed, counters=counters, exclude_ids=exclude_ids, weight_layout=layout,
                           impl=attn_impl)

    def head_weight(self) -> tuple[jax.Array, str]:
        """The output projection as stored and its layout: the tied embedding [V, D] ("vd") or
        the LM head [D, V] ("dv")."""
        if self.cfg.tie_embeddings:
            return self.embed[...], "vd"
        return self.lm_head[...], "dv"

    def _feature_slots(self, feature_layers: Sequence[int]) -> np.ndarray:
        """int32 [L]: each layer's index among the requested feature layers, -1 if not requested."""
        slots = np.full((self.cfg.num_layers,), -1, np.int32)
        for i, layer_id in enumerate(feature_layers):
            if not 0 <= layer_id < self.cfg.num_layers or slots[layer_id] >= 0:
                raise ValueError(f"feature layer ids must be distinct and in [0, {self.cfg.num_layers}); "
                                 f"got {list(feature_layers)}")
            slots[layer_id] = i
        return slots

    def _run_stack(self, tokens: jax.Array, positions: jax.Array, feature_layers: Sequence[int],
                   attend, cache: KVCache | None, write=None):
        """The layers, shared by every forward: a scan (stacked layout) or a loop (per layer).

        tokens/positions [B, T]; `attend(q, k, v, lk, lv)` maps one layer's q [B,H,T,Dh],
        new k/v [B,Hkv,T,Dh] and cached k/v [B,Hkv,S,Dh] (None without a cache) to the
        attention heads [B,H,T,Dh]. Per layer, `write(lk, lv, k, v) -> (lk, lv)` puts the
        layer's new K/V into its cache buffers before `attend` reads them (None: the cache is
        only read); `attend` must mask the written slots as it masks any slot past a length.
        Returns (final-norm hidden [B,T,D], features [B,T,k*D] or None, every layer's new k
        and v [L,B,Hkv,T,Dh], the written per-layer cache buffers (k, v) or None).
        """
        cfg = self.cfg
        b, t = tokens.shape
        inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = layers.rope_tables(positions, inv_freq)
        slots = self._feature_slots(feature_layers)
        num_feats = len(feature_layers)
        x = self.embed_tokens(tokens)

        def layer(x, p, lk, lv):
            h = layers.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q, k, v = project_qkv(p, h, cfg, cos, sin)
            if write is not None:
                lk, lv = write(lk, lv, k, v)
            x = x + attention_out(p, attend(q, k, v, lk, lv))
            h = layers.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            return x + layers.swiglu(h, p["w_gate"], p["w_up"], p["w_down"]), k, v, lk, lv

        if cache is not None and cache.per_layer != self.layers.per_layer:
            want, got = ("per-layer", "stacked") if self.layers.per_layer else ("stacked", "per-layer")
            raise ValueError(f"a {want}-layout model takes a {want} KV cache; got a {got} one "
                             "(create it with `decoding.autoregressive.new_cache`)")
        if self.layers.per_layer:
            x, feats, new_k, new_v, written = self._loop(layer, x, slots, cache)
        else:
            x, feats, new_k, new_v = self._scan(layer, x, slots, num_feats, cache)
            written = None
        hidden = layers.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        features = None
        if num_feats:
            features = jnp.moveaxis(feats, 0, 2).reshape(b, t, num_feats * cfg.hidden_size)
        return hidden, features, new_k, new_v, written

    def _scan(self, layer, x, slots, num_feats: int, cache: KVCache | None):
        """The stacked layout: one scan over the layers; feature slots filled in the carry.

        Every layer writes its output to a slot of the carry in place: its feature slot, or a
        spare slot past them that is dropped. (Keeping the other slots with a select read and
        rewrote the whole carry every layer: +3-5% on a 32 x 256-token prefill.)"""
        feats = jnp.zeros((num_feats + 1,) + x.shape, x.dtype)

        def body(carry, xs):
            x, feats = carry
            p, slot, lk, lv = xs
            x, k, v, _, _ = layer(x, p, lk, lv)
            if num_feats:
                feats = jax.lax.dynamic_update_index_in_dim(feats, x, jnp.where(slot >= 0, slot, num_feats), 0)
            return (x, feats), (k, v)

        ck, cv = (cache.k, cache.v) if cache is not None else (None, None)
        xs = (self.layers.arrays(x.dtype), jnp.asarray(slots), ck, cv)
        (x, feats), (new_k, new_v) = jax.lax.scan(body, (x, feats), xs)
        return x, feats[:num_feats], new_k, new_v

    def _loop(self, layer, x, slots, cache: KVCache | None):
        """The per-layer layout: an unrolled loop over each layer's own weight and cache buffers."""
        feats = [None] * max(int(slots.max()) + 1, 0)
        ks, vs, written_k, written_v = [], [], [], []
        for i, p in enumerate(self.layers.layer_arrays(x.dtype)):
            lk, lv = (cache.k[i], cache.v[i]) if cache is not None else (None, None)
            x, k, v, lk, lv = layer(x, p, lk, lv)
            ks.append(k), vs.append(v), written_k.append(lk), written_v.append(lv)
            if slots[i] >= 0:
                feats[slots[i]] = x
        feats = jnp.stack(feats) if feats else None
        written = (tuple(written_k), tuple(written_v)) if cache is not None else None
        return x, feats, jnp.stack(ks), jnp.stack(vs), written

    def __call__(self, tokens: jax.Array, *, cache: KVCache | None = None,
                 positions: jax.Array | None = None, feature_layers: Sequence[int] = (),
                 attn_impl: str = "xla", empty_cache: bool = False) -> ForwardOutput:
        """Runs tokens [B, T] through the stack.

        With a cache, token t of sequence b sits at position `cache.lengths[b] + t`
        (unless `positions` is given), its K/V are written there, and it attends to
        every cached position at or before its own. Without a cache, attention is
        causal over `positions` (default 0..T-1). empty_cache: the cache holds nothing
        of these rows yet (a prompt's prefill, every length 0), so attention runs over the
        T new tokens alone, not over the cache's max_len empty slots as well (which
        more than doubled a 256-token prefill's attention into a 352-slot cache).
        """
        b, t = tokens.shape
        if positions is None:
            start = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
            positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        if cache is not None:
            write_at = positions[:, 0]
        if cache is not None and not empty_cache:
            # Keys = the layer's cached slots, then the T new tokens (slots write_at + j); a
            # query sees committed slots (< write_at) and new tokens up to its own position.
            slot = jnp.arange(cache.max_len, dtype=jnp.int32)[None, None, :]
            new_slot = write_at[:, None, None] + jnp.arange(t, dtype=jnp.int32)[None, None, :]
            mask = jnp.concatenate([(slot < write_at[:, None, None]) & (slot <= positions[:, :, None]),
                                    new_slot <= positions[:, :, None]], axis=-1)
        else:
            mask = positions[:, None, :] <= positions[:, :, None]

        def attend(q, k, v, lk, lv):
            keys, values = k, v
            if lk is not None:
                keys, values = (lk.astype(q.dtype), k), (lv.astype(q.dtype), v)
            return layers.attention(q, keys, values, mask, impl=attn_impl)

        def write(lk, lv, k, v):  # per-layer cache: each layer writes its own buffers
            return write_layer_tokens(lk, lv, k, v, write_at)

        read = None if empty_cache else cache  # an empty cache is only written, after the stack
        per_layer_cache = read is not None and read.per_layer
        hidden, features, new_k, new_v, written = self._run_stack(
            tokens, positions, feature_layers, attend, read, write if per_layer_cache else None)
        new_cache = None
        if written is not None:  # per layer: each layer wrote its own buffers
            new_cache = cache.replace(k=written[0], v=written[1])
        elif cache is not None and cache.per_layer:  # an empty per-layer cache: each layer's K/V now
            ck, cv = zip(*(write(lk, lv, k, v) for lk, lv, k, v in zip(cache.k, cache.v, new_k, new_v)))
            new_cache = cache.replace(k=tuple(ck), v=tuple(cv))
        elif cache is not None:  # stacked: one write of every layer's new K/V, after the layer scan
            ck, cv = write_tokens(cache.k, cache.v, new_k, new_v, write_at)
            new_cache = cache.replace(k=ck, v=cv)
        return ForwardOutput(hidden, features, new_cache)

    def packed_forward(self, tokens: jax.Array, layout, cache: KVCache, *,
                       feature_layers: Sequence[int] = (), attn_impl: str = "xla") -> ForwardOutput:
        """Runs the packed tokens [N] of `layout` (a `models.packed_layout.PackedLayout`).

        Slot j is token `layout.offsets[j]` of row `layout.seq_ids[j]`'s verified span,
        at position `cache.lengths[row] + offset`. Projections, MLP and features run on
        the N packed tokens only, so a verify step pays for the tokens it verifies.
        Returns hidden [N, D], features [N, k*D] and the cache with the valid slots'
        K/V written (padding slots land past the cache and are dropped; lengths NOT
        advanced).
        """
        positions = cache.lengths[layout.seq_ids] + layout.offsets

        def attend(q, k, v, lk, lv):  # the stack sees the packed tokens as one [1, N] row
            out = layers.packed_attention(
                jnp.swapaxes(q[0], 0, 1), jnp.swapaxes(k[0], 0, 1), jnp.swapaxes(v[0], 0, 1),
                lk, lv, layout, cache.lengths, positions, impl=attn_impl)
            return jnp.swapaxes(out, 0, 1)[None]

        def write(lk, lv, k, v):  # k/v [1, Hkv, N, Dh]
            return write_layer_packed(lk, lv, jnp.swapaxes(k[0], 0, 1), jnp.swapaxes(v[0], 0, 1),
                                      layout.seq_ids, positions)

        hidden, features, new_k, new_v, written = self._run_stack(
            tokens[None], positions[None], feature_layers, attend, cache, write if cache.per_layer else None)
        if written is not None:
            ck, cv = written
        else:
            ck, cv = write_packed(cache.k, cache.v, jnp.swapaxes(new_k[:, 0], 1, 2),
                                  jnp.swapaxes(new_v[:, 0], 1, 2), layout.seq_ids, positions)
        return ForwardOutput(hidden[0], None if features is None else features[0],
                             cache.replace(k=ck, v=cv))

    def tree_forward(self, tokens: jax.Array, depths: jax.Array, ancestors: jax.Array, cache: KVCache, *,
                     feature_layers: Sequence[int] = (), attn_impl: str = "xla") -> TreeForwardOutput:
        """Runs the N nodes of a draft tree per row (tree verification).

        tokens/depths int [B, N]; node i sits at position `cache.lengths[b] + depths[b, i]`
        and sees the cached slots < cache.lengths[b] plus the nodes j with
        ancestors[b, i, j] (bool [B, N, N]: its ancestors and itself). The cache is only
        read: the nodes' K/V come back per node, and the caller writes the accepted path's
        at contiguous positions (`kv_cache.path_entries`). Keeping the write out of here lets a
        step that picks its budget in a `lax.switch` pass the cache into the branches
        read-only, so XLA does not copy it into each branch.
        """
        positions = cache.lengths[:, None] + depths

        def attend(q, k, v, lk, lv):
            return layers.tree_attention(q, k, v, lk, lv, cache.lengths, ancestors, impl=attn_impl)

        hidden, features, new_k, new_v, _ = self._run_stack(tokens, positions, feature_layers, attend, cache)
        return TreeForwardOutput(hidden, features, new_k, new_v)

    def packed_tree_forward(self, tokens: jax.Array, depths: jax.Array, layout, ancestors: jax.Array,
                            cache: KVCache, *, feature_layers: Sequence[int] = (),
                            attn_impl: str = "xla") -> TreeForwardOutput:
        """Runs the packed nodes [N] of per-row draft trees (tree verification, packed).

        Slot j is node `layout.offsets[j]` of row `layout.seq_ids[j]`'s tree (each row's first
        layout.lengths[b] nodes, contiguous), at position `cache.lengths[row] + depths[j]`;
        ancestors bool [B, W, W] (W = layout.block_size) as in `tree_forward`. Projections,
        MLP and features run on the N packed tokens; attention on the padded [B, W] layout.
        Returns hidden [N, D], features [N, k*D] and every layer's K/V [L, B, Hkv, W, Dh]
        per node; the cache is only read.
        """
        positions = cache.lengths[layout.seq_ids] + depths
        width = layout.block_size
        valid = jnp.arange(width)[None] < layout.lengths[:, None]
        mask = ancestors & valid[:, None, :]

        def padded(x):  # [1, heads, N, Dh] -> [B, heads, W, Dh]
            return jnp.swapaxes(layout.unpack(jnp.swapaxes(x[0], 0, 1)), 1, 2)

        def attend(q, k, v, lk, lv):
            out = layers.tree_attention(padded(q), padded(k), padded(v), lk, lv, cache.lengths, mask,
                                        impl=attn_impl)
            return jnp.swapaxes(layout.pack(jnp.swapaxes(out, 1, 2)), 0, 1)[None]

        hidden, features, new_k, new_v, _ = self._run_stack(tokens[None], positions[None], feature_layers,
                                                            attend, cache)
        node_k, node_v = (jax.vmap(padded)(x) for x in (new_k, new_v))
        return TreeForwardOutput(hidden[0], None if features is None else features[0], node_k, node_v)

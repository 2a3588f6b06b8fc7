"""Decoder layers' weights in two layouts, the projections every model applies to them.

- `DecoderStack`, stacked: each weight carries a leading `layers` axis and the
  model runs them with `lax.scan`, one compiled layer body (short compiles, and
  what training and checkpoint loading use).
- `DecoderLayers`, per layer: one buffer per layer and weight, run by an unrolled
  loop (the inference layout, `load_target(..., layer_layout="per_layer")`). On CPU,
  XLA copies each layer's weights out of a stacked array before every matmul that
  slices them inside a scan (a `dynamic-slice` fusion per weight per layer);
  per-layer buffers are read in place: SmolLM2-135M's batch-32 AR step ran 17%
  faster and its 16-token verify 12% faster (`benchmarks/step_floors.py`). The
  price: programs compile ~4x slower and hold ~4x more memory mappings (~525
  against ~140 per program), so a process that compiles a few hundred programs
  meets the kernel's `vm.max_map_count`; hence not the default.

`to_layout` converts a model's weights between the two, exactly (a slice or a stack).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.models import layers
from adaflash_jax.models.config import ModelConfig

LAYER_LAYOUTS = ("stacked", "per_layer")


def new_param(key, shape, axes, dtype, init: str = "normal", std: float = 0.02) -> nnx.Param:
    """A parameter of `shape` with logical axis names `axes`: normal(0, std), ones or zeros."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class _Weights(nnx.Module):
    """Decoder-layer weights named as in `layer_shapes`, with `lead` extra leading axes."""

    def __init__(self, cfg: ModelConfig, lead: tuple[tuple[int, str], ...], *, rngs: nnx.Rngs):
        sizes, names = tuple(n for n, _ in lead), tuple(a for _, a in lead)
        for name, (shape, axes, init) in layer_shapes(cfg).items():
            key = rngs.params() if init == "normal" else None
            setattr(self, name, new_param(key, sizes + shape, names + axes, cfg.weight_dtype, init))

    def arrays(self, dtype) -> dict[str, jax.Array]:
        """The weights as plain arrays in the compute dtype."""
        return {name: var[...].astype(dtype) for name, var in vars(self).items()
                if isinstance(var, nnx.Param)}


class DecoderStack(_Weights):
    """All decoder layers' weights, stacked on a leading layer axis (the scan's xs)."""

    per_layer = False

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, ((cfg.num_layers, "layers"),), rngs=rngs)


def head_projection(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [B,T,D] @ w [D,H,Dh] -> [B,H,T,Dh]: one 2-D matmul, then the small activation is
    transposed (an einsum straight to head-major output makes XLA transpose the weight instead,
    every call)."""
    b, t, _ = x.shape
    d, h, dh = w.shape
    return (x @ w.reshape(d, h * dh)).reshape(b, t, h, dh).transpose(0, 2, 1, 3)


def project_kv(p: dict, x: jax.Array, cfg: ModelConfig, cos, sin):
    """k/v [B,Hkv,T,Dh] of one layer's params `p` for inputs x [B,T,D]; k normed and rotated.

    Non-finite values become 0, keys stay as they are. Every attention masks scores with a
    select, so a NaN key at a masked slot is dropped, but a masked slot's value still enters
    probs @ V with weight 0, and 0 x NaN = NaN: a NaN value would reach queries that must not
    see it (another row's padding in a packed verify, a rejected draft or an earlier request
    left in the cache). A NaN key at a visible slot still makes the query's output NaN, so
    every query that attends to a non-finite token stays non-finite and is caught.
    """
    k, v = head_projection(x, p["wk"]), head_projection(x, p["wv"])
    if "bk" in p:
        k = k + p["bk"][None, :, None]
        v = v + p["bv"][None, :, None]
    if "k_norm" in p:
        k = layers.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return layers.apply_rope(k, cos, sin), layers.finite_or_zero(v)


def project_q(p: dict, x: jax.Array, cfg: ModelConfig, cos, sin):
    """q [B,H,T,Dh] of one layer's params `p`; normed (Qwen3) and rotated."""
    q = head_projection(x, p["wq"])
    if "bq" in p:
        q = q + p["bq"][None, :, None]
    if "q_norm" in p:
        q = layers.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    return layers.apply_rope(q, cos, sin)


def project_qkv(p: dict, x: jax.Array, cfg: ModelConfig, cos, sin):
    """q [B,H,T,Dh], k/v [B,Hkv,T,Dh] for one layer, rotated at cos/sin."""
    return (project_q(p, x, cfg, cos, sin),) + project_kv(p, x, cfg, cos, sin)


def attention_out(p: dict, attn: jax.Array) -> jax.Array:
    """Output projection of attention heads [B,H,T,Dh] -> [B,T,D]."""
    b, h, t, dh = attn.shape
    out = attn.transpose(0, 2, 1, 3).reshape(b, t, h * dh) @ p["wo"].reshape(h * dh, -1)
    return out + p["bo"] if "bo" in p else out


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], str]]:
    """Each layer weight's (shape, logical axes, init) without the layer axis."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    H, KV, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {"attn_norm": ((D,), ("norm",), "ones"),
              "wq": ((D, H, Dh), ("embed", "q_heads", "head_dim"), "normal"),
              "wk": ((D, KV, Dh), ("embed", "kv_heads", "head_dim"), "normal"),
              "wv": ((D, KV, Dh), ("embed", "kv_heads", "head_dim"), "normal"),
              "wo": ((H, Dh, D), ("q_heads", "head_dim", "embed"), "normal")}
    if cfg.attention_bias:
        shapes.update(bq=((H, Dh), ("q_heads", "head_dim"), "zeros"),
                      bk=((KV, Dh), ("kv_heads", "head_dim"), "zeros"),
                      bv=((KV, Dh), ("kv_heads", "head_dim"), "zeros"), bo=((D,), ("norm",), "zeros"))
    if cfg.qk_norm:
        shapes.update(q_norm=((Dh,), ("head_dim",), "ones"), k_norm=((Dh,), ("head_dim",), "ones"))
    shapes.update(mlp_norm=((D,), ("norm",), "ones"), w_gate=((D, F), ("embed", "mlp"), "normal"),
                  w_up=((D, F), ("embed", "mlp"), "normal"), w_down=((F, D), ("mlp", "embed"), "normal"))
    return shapes


class DecoderLayer(_Weights):
    """One decoder layer's weights (the per-layer inference layout)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, (), rngs=rngs)


class DecoderLayers(nnx.Module):
    """All decoder layers, one `DecoderLayer` each: the model runs them in an unrolled loop."""

    per_layer = True

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.items = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])

    def layer_arrays(self, dtype) -> list[dict[str, jax.Array]]:
        """Every layer's weights as plain arrays in the compute dtype, in layer order."""
        return [layer.arrays(dtype) for layer in self.items]


def to_layout(model: nnx.Module, layout: str) -> nnx.Module:
    """`model` (whose `layers` attribute holds its decoder layers) with the layers in `layout`,
    the same values: stacked -> per layer slices the stacked arrays, per layer -> stacked stacks
    them. The model is changed in place and returned."""
    if layout not in LAYER_LAYOUTS:
        raise ValueError(f"unknown layer layout {layout!r}; choose one of {LAYER_LAYOUTS}")
    current = model.layers
    if (layout == "per_layer") == current.per_layer:
        return model
    cfg = model.cfg
    fresh = nnx.eval_shape(lambda: (DecoderLayers if layout == "per_layer" else DecoderStack)(
        cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(fresh)
    pure = nnx.to_pure_dict(nnx.split(current)[1])
    if layout == "per_layer":
        new = {"items": {i: {name: w[i] for name, w in pure.items()} for i in range(cfg.num_layers)}}
    else:
        new = {name: jnp.stack([pure["items"][i][name] for i in range(cfg.num_layers)])
               for name in pure["items"][0]}
    nnx.replace_by_pure_dict(state, new)
    model.layers = nnx.merge(graphdef, state)
    return model

"""Typed configuration of a causal target LM (Llama and Qwen3 families).

One dataclass covers both families; the differences are flags (q/k-norm,
attention bias, tied embeddings, rope scaling). `from_hf_config` reads an HF
`config.json` dict, in both the legacy (`rope_theta`/`rope_scaling`) and the
newer (`rope_parameters`) spelling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "mistral")


def resolve_dtype(name: str):
    """Maps a dtype name from a config to a jnp dtype, with a clear error."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of a target LM."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        resolve_dtype(self.dtype)
        resolve_dtype(self.param_dtype)

    @property
    def compute_dtype(self):
        return resolve_dtype(self.dtype)

    @property
    def weight_dtype(self):
        return resolve_dtype(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, h, kv, hd = (self.hidden_size, self.intermediate_size, self.num_heads,
                           self.num_kv_heads, self.head_dim)
        attn = d * h * hd * 2 + d * kv * hd * 2
        per_layer = attn + 3 * d * f + 2 * d + (2 * hd if self.qk_norm else 0)
        if self.attention_bias:
            per_layer += h * hd + 2 * kv * hd + d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * per_layer + d + head


def _rope_fields(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _attention_window(hf: dict[str, Any]) -> int | None:
    """Sliding-window size if any layer uses one (Mistral, Qwen3 with `use_sliding_window`)."""
    window = hf.get("sliding_window")
    if not window:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if hf.get("model_type") == "qwen3":
        sliding = hf.get("use_sliding_window") and int(hf.get("max_window_layers", 0)) < int(
            hf["num_hidden_layers"])
        return int(window) if sliding else None
    return int(window)


def from_hf_config(hf: dict[str, Any], *, dtype: str = "float32",
                   param_dtype: str | None = None) -> ModelConfig:
    """Builds a ModelConfig from an HF `config.json` dict."""
    model_type = hf.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks required keys: {missing}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
    heads = int(hf["num_attention_heads"])
    theta, scaling = _rope_fields(hf)
    max_positions = int(hf.get("max_position_embeddings", 8192))
    window = _attention_window(hf)
    if window is not None:
        # Full causal attention equals sliding-window attention up to the window length,
        # so such models are exact when sequences are capped there.
        max_positions = min(max_positions, window)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=max_positions,
        model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        dtype=dtype,
        param_dtype=param_dtype or dtype,
    )
